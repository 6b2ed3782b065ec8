"""The instruction-set level pdserve runs at: read from the CPU's flags, checked against what
torch itself detects; PDSERVE_ISA forces a lower level and refuses a higher one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdserve.model import isa
from pdserve.model.isa import Isa, level_of


@pytest.fixture
def fresh() -> Iterator[None]:
    isa.chosen_isa.cache_clear()
    yield
    isa.chosen_isa.cache_clear()


def test_host_level_agrees_with_torch() -> None:
    capability = torch.backends.cpu.get_cpu_capability()  # torch's own cpuid reading
    host = isa.host_isa()
    assert (host >= Isa.AVX2) == (capability in ("AVX2", "AVX512"))
    if host >= Isa.AVX512:
        assert capability == "AVX512"


def test_levels_need_every_lower_level() -> None:
    avx512 = isa.REQUIRED[Isa.AVX2] | isa.REQUIRED[Isa.AVX512]
    assert level_of(avx512) == Isa.AVX512
    assert level_of(avx512 - {"avx512_bf16"}) == Isa.AVX2  # AVX512 without bf16: not native
    assert level_of(isa.REQUIRED[Isa.AMX] | isa.REQUIRED[Isa.AVX2]) == Isa.AVX2
    assert level_of(set()) == Isa.GENERIC
    assert Isa.AMX.kernel_level == Isa.AVX512 and Isa.AMX.native_bf16
    assert not Isa.AVX2.native_bf16


def test_a_lower_level_can_be_forced(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_ISA", "generic")
    assert isa.chosen_isa() == Isa.GENERIC


def test_a_level_above_the_host_is_refused(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if isa.host_isa() == Isa.AMX:
        pytest.skip("this CPU executes every level")
    above = Isa(isa.host_isa() + 1)
    monkeypatch.setenv("PDSERVE_ISA", above.name.lower())
    with pytest.raises(ValueError, match="this CPU executes"):
        isa.chosen_isa()
    monkeypatch.setenv("PDSERVE_ISA", "sse9")
    isa.chosen_isa.cache_clear()
    with pytest.raises(ValueError, match="expected one of"):
        isa.chosen_isa()
