"""The single-pass host Adam's CPU probe (``OFFLOAD_HOST_ADAM_CPU_PROBE``): each launch's
wall time, its process's CPU time and the machine's over it. What the long kernels show
is read on the GPU machine (gpu_session.sh cpuprobe), not here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offload_optim import single_pass
from offload_optim.kernels import AdamHyper

pytestmark = pytest.mark.skipif(not single_pass.available(), reason="numba missing")

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)


@pytest.fixture(autouse=True)
def _empty_record() -> Iterator[None]:
    single_pass.kernel_cpu_samples(clear=True)
    yield
    single_pass.kernel_cpu_samples(clear=True)


def _step(n: int) -> torch.Tensor:
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    single_pass.adam_(p, g, m, v, torch.tensor(1.0), HYPER)
    return p


def test_probe_off_records_nothing_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OFFLOAD_HOST_ADAM_CPU_PROBE", raising=False)
    torch.manual_seed(0)
    off = _step(1 << 17)
    assert single_pass.kernel_cpu_samples() == []
    monkeypatch.setenv("OFFLOAD_HOST_ADAM_CPU_PROBE", "1")
    torch.manual_seed(0)
    on = _step(1 << 17)
    assert torch.equal(off, on)  # the probe only watches


def test_each_launch_records_its_wall_and_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOAD_HOST_ADAM_CPU_PROBE", "1")
    for n in (1 << 16, 3 << 18):
        _step(n)
    first, second = single_pass.kernel_cpu_samples(clear=True)
    assert single_pass.kernel_cpu_samples() == []
    assert (first.numel, second.numel) == (1 << 16, 3 << 18)
    for k in (first, second):
        assert k.wall_s > 0 and k.process_cpu_s >= 0
        assert 1 <= k.threads <= max(1, torch.get_num_threads())
        # The process's CPU time cannot exceed every core of the machine over the kernel
        # (with slack for the clocks' granularity).
        assert k.process_cpu_s <= k.wall_s * (torch.get_num_threads() + 2) + 0.02
        assert k.machine_busy_s is None or k.machine_busy_s >= 0


def test_machine_busy_time_reads_proc_stat_and_grows() -> None:
    a = single_pass._machine_busy_s()
    if a is None:
        pytest.skip("/proc/stat cannot be read here")
    torch.randn(1 << 22).sort()
    b = single_pass._machine_busy_s()
    assert b is not None and b >= a


def test_a_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOAD_HOST_ADAM_CPU_PROBE", "yes")
    with pytest.raises(ValueError, match="OFFLOAD_HOST_ADAM_CPU_PROBE='yes'"):
        single_pass.cpu_probe()
    monkeypatch.setenv("OFFLOAD_HOST_ADAM_CPU_PROBE", "0")
    assert not single_pass.cpu_probe()
