"""What crosses the wire between nodes and to gRPC clients, built and read in this package
only: gRPC options and status mapping (`channel`), checks of values as they arrive (`checks`),
the control messages (`control`), the transfer plane's frames (`frames`) and the model
fingerprint two peers compare (`terms`). Everything is
importable from `pdserve.disagg.wire` itself."""

from pdserve.disagg.wire.channel import *  # noqa: F403
from pdserve.disagg.wire.checks import *  # noqa: F403
from pdserve.disagg.wire.control import *  # noqa: F403
from pdserve.disagg.wire.frames import *  # noqa: F403
from pdserve.disagg.wire.terms import *  # noqa: F403
