"""What crosses the wire between nodes and to gRPC clients, built and read in this package
only: gRPC options and status mapping (`channel`), checks of values as they arrive (`checks`),
the control messages (`control`) and the transfer plane's frames (`frames`). Everything is
importable from `pdserve.disagg.wire` itself."""

from pdserve.disagg.wire.channel import *  # noqa: F403
from pdserve.disagg.wire.checks import *  # noqa: F403
from pdserve.disagg.wire.control import *  # noqa: F403
from pdserve.disagg.wire.frames import *  # noqa: F403
