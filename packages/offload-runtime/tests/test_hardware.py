"""Hardware profiling: the CPU default, the per-device cache, and (on a GPU) real numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import re
import types
import warnings
from pathlib import Path

import pytest
import torch

from offload_runtime import hardware
from offload_runtime.hardware import (
    DEFAULT_COMPUTE_EFFICIENCY,
    AttentionShape,
    DeviceIdentity,
    cache,
    default_cache_dir,
    default_cpu_profile,
    device_identity,
    host_adam_median,
    issue_cost,
    measure_attention_flop_per_s,
    measure_device_memory_bytes_per_s,
    measure_host_adam_params_per_s,
    measure_host_convert_elems_per_s,
    measure_host_copy_contention,
    measure_host_memory_bytes_per_s,
    measure_op_overhead_s,
    probes,
    profile_hardware,
)
from offload_runtime.hardware import measure_hardware as real_measure_hardware
from offload_runtime.hardware import profile as hw_profile
from offload_solver import BandwidthPoint, HardwareProfile

FAKE_IDENTITY = DeviceIdentity(
    device_type="cuda",
    index=0,
    name="NVIDIA Fake GPU/80GB",
    uuid="GPU-0123abcd-0000-1111-2222-333344445555",
    pci_bus_id="00000000:01:00.0",
    total_memory_bytes=80 * 2**30,
    driver_version="999.1",
    cuda_version="13.0",
    torch_version="2.11.0+cu130",
    source="nvml",
)

FAKE_PROFILE = HardwareProfile(
    name="NVIDIA Fake GPU (float16)",
    h2d=(BandwidthPoint(1024, 1e9), BandwidthPoint(2**30, 50e9)),
    d2h=(BandwidthPoint(1024, 2e9), BandwidthPoint(2**30, 51e9)),
    compute_flop_per_s=700e12,
    compute_efficiency=DEFAULT_COMPUTE_EFFICIENCY,
    device_memory_bytes=80 * 2**30,
    host_memory_bytes=256 * 2**30,
    host_adam_params_per_s=4e9,
    device_adam_params_per_s=90e9,
    op_overhead_s=15e-6,
    host_convert_elems_per_s=10.5e9,
)

FAKE_EFFICIENCY = 0.25


class FakeCuda:
    """Pretends a CUDA device exists and counts the measurements made on it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.measure_calls = 0
        self.efficiency_calls = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(hw_profile, "device_identity", lambda device=None: FAKE_IDENTITY)
        monkeypatch.setattr(hw_profile, "measure_hardware", self._measure)
        monkeypatch.setattr(hw_profile, "measure_matmul_efficiency", self._efficiency)

    def _measure(self, device: torch.device, **kwargs: object) -> HardwareProfile:
        assert device == torch.device("cuda", 0)
        self.measure_calls += 1
        return FAKE_PROFILE

    def _efficiency(self, device: torch.device, shapes: object, **kwargs: object) -> float:
        self.efficiency_calls += 1
        return FAKE_EFFICIENCY


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def _cache_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


# ---------------------------------------------------------------------------- CPU default


def test_default_cpu_profile_is_valid_constant_and_round_trips() -> None:
    first, second = default_cpu_profile(), default_cpu_profile()
    assert first == second
    assert HardwareProfile.from_json(first.to_json()) == first
    assert "not measured" in first.name
    # A region copy and a step take a positive, finite, size-dependent time.
    assert 0 < first.h2d_time_s(2**20) < first.h2d_time_s(2**30)
    assert first.d2h_time_s(2**20) > 0
    assert first.compute_time_s(10**9) > 0
    # Memory bandwidths are left unknown: no constant would describe this machine's.
    assert first.host_memory_bytes_per_s == 0.0 and first.device_memory_bytes_per_s == 0.0


def test_no_cuda_gives_the_default_profile_and_writes_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in (None, "cpu", torch.device("cpu")):
        profile = profile_hardware(device, cache_dir=tmp_path, progress=False)
        assert profile == default_cpu_profile()
    assert not list(tmp_path.iterdir())


def test_cpu_device_gets_the_default_even_when_cuda_is_present(
    tmp_path: Path, fake_cuda: FakeCuda
) -> None:
    assert profile_hardware("cpu", cache_dir=tmp_path, progress=False) == default_cpu_profile()
    assert fake_cuda.measure_calls == 0
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_cuda_is_a_named_error(
    device: str | torch.device, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        profile_hardware(device, cache_dir=tmp_path, progress=False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        device_identity(device)


@pytest.mark.parametrize("device", ["meta", "not-a-device"])
def test_unsupported_device_is_a_value_error(device: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(device))):
        profile_hardware(device, cache_dir=tmp_path, progress=False)


def test_cuda_index_out_of_range_is_a_value_error(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="out of range"):
        profile_hardware("cuda:3", cache_dir=tmp_path, progress=False)


def test_unsupported_dtype_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="float64"):
        profile_hardware("cpu", dtype=torch.float64, cache_dir=tmp_path, progress=False)


@pytest.mark.parametrize("shape", [(0, 4, 4), (4, -1, 4), (4, 4), (4.0, 4, 4), (True, 4, 4)])
def test_malformed_matmul_shape_is_a_value_error(shape: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"matmul_shapes\[1\]"):
        profile_hardware(
            "cpu",
            matmul_shapes=[(8, 8, 8), shape],  # type: ignore[list-item]
            cache_dir=tmp_path,
            progress=False,
        )


# ---------------------------------------------------------------------------- cache


def test_profile_is_measured_once_then_loaded_from_the_cache(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    first = profile_hardware("cuda:0", cache_dir=tmp_path, progress=False)
    assert fake_cuda.measure_calls == 1
    files = _cache_files(tmp_path)
    assert len(files) == 1
    assert FAKE_IDENTITY.cache_key in files[0].name
    assert "float16" in files[0].name
    assert HardwareProfile.from_json(files[0].read_text()) == FAKE_PROFILE

    second = profile_hardware("cuda:0", cache_dir=tmp_path, progress=False)
    assert fake_cuda.measure_calls == 1
    assert second == first == FAKE_PROFILE


def test_profiles_cached_before_the_conversion_rate_are_measured_again(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    # A file named without a format tag, lacking host_convert_elems_per_s: reading it
    # would plan without the host conversions, so it is ignored and the device re-measured.
    old_doc = json.loads(FAKE_PROFILE.to_json())
    del old_doc["host_convert_elems_per_s"]
    old_path = tmp_path / f"hardware-{FAKE_IDENTITY.cache_key}-float16.json"
    old_path.write_text(json.dumps(old_doc))
    assert HardwareProfile.from_json(old_path.read_text()).host_convert_elems_per_s == 0.0

    profile = profile_hardware("cuda:0", cache_dir=tmp_path, progress=False)
    assert fake_cuda.measure_calls == 1
    assert profile.host_convert_elems_per_s == 10.5e9
    new_files = [f for f in _cache_files(tmp_path) if f != old_path]
    assert len(new_files) == 1
    assert new_files[0].name.startswith(f"hardware-{cache.CACHE_FORMAT}-")
    assert HardwareProfile.from_json(new_files[0].read_text()) == FAKE_PROFILE


def test_measure_hardware_fills_conversion_rate_and_issue_cost(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every device measurement is replaced by a constant; what is checked is that the
    # host conversion rate and the per-operation cost (the median of its three reads)
    # reach the profile, measured in the training dtype.
    calls: dict[str, tuple[object, object]] = {}
    points = (BandwidthPoint(1024, 1e9), BandwidthPoint(2**30, 50e9))

    def convert(numel: int, *, dtype: torch.dtype, reps: int = 3) -> float:
        calls["convert"] = (numel, dtype)
        return 9.5e9

    # The issue cost is read first, midway and last; the median is kept.
    reads = iter([27e-6, 16e-6, 21e-6])

    def overhead(device: torch.device, *, dtype: torch.dtype | None = None, **_: object) -> float:
        calls["overhead"] = (device, dtype)
        return next(reads)

    monkeypatch.setattr(hw_profile, "measure_copy_bandwidth", lambda dev: (points, points))
    monkeypatch.setattr(hw_profile, "measure_peak_matmul_flop_per_s", lambda dev, dtype: 700e12)
    # The host Adam rate too: one read taken while the host was busy (a third of the
    # others) is dropped.
    adam_reads = iter([1.4e9, 4.4e9, 4.1e9])
    adam_numels: list[int] = []

    def host_adam(numel: int) -> float:
        adam_numels.append(numel)
        return next(adam_reads)

    monkeypatch.setattr(hw_profile, "measure_host_adam_params_per_s", host_adam)
    monkeypatch.setattr(hw_profile, "measure_host_copy_contention", lambda dev, numel: 0.7)
    monkeypatch.setattr(hw_profile, "measure_device_adam_params_per_s", lambda dev: 90e9)
    monkeypatch.setattr(hw_profile, "measure_device_memory_bytes_per_s", lambda dev: 4.2e12)
    monkeypatch.setattr(hw_profile, "measure_host_convert_elems_per_s", convert)

    def host_memory(numel: int) -> float:
        calls["host_memory"] = (numel, None)
        return 120e9

    monkeypatch.setattr(hw_profile, "measure_host_memory_bytes_per_s", host_memory)
    monkeypatch.setattr(hw_profile, "measure_op_overhead_s", overhead)
    monkeypatch.setattr(hw_profile, "release_cached_memory", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (70 * 2**30, 80 * 2**30))

    with pytest.warns(RuntimeWarning, match=r"host Adam reads disagree \(1\.40, 4\.40, 4\.10"):
        profile = real_measure_hardware(
            torch.device("cuda", 0), dtype=torch.bfloat16, identity=FAKE_IDENTITY
        )
    assert profile.host_adam_params_per_s == 4.1e9  # the median of the three reads
    assert next(adam_reads, None) is None
    assert len(set(adam_numels)) == 1 and 0 < adam_numels[0] <= 32 * 2**20
    assert profile.host_convert_elems_per_s == 9.5e9
    assert profile.op_overhead_s == 21e-6
    assert next(reads, None) is None  # read exactly three times
    assert profile.device_memory_bytes_per_s == 4.2e12
    assert profile.host_copy_contention == 0.7
    assert profile.host_memory_bytes_per_s == 120e9
    memory_numel, _ = calls["host_memory"]  # fitted to the host's available memory
    assert isinstance(memory_numel, int) and 0 < memory_numel <= 64 * 2**20
    numel, dtype = calls["convert"]
    assert dtype == torch.bfloat16
    assert isinstance(numel, int) and 0 < numel <= 32 * 2**20
    assert calls["overhead"] == (torch.device("cuda", 0), torch.bfloat16)
    assert HardwareProfile.from_json(profile.to_json()) == profile


def test_each_dtype_has_its_own_cache_file(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    profile_hardware("cuda:0", cache_dir=tmp_path, dtype=torch.float16, progress=False)
    profile_hardware("cuda:0", cache_dir=tmp_path, dtype=torch.bfloat16, progress=False)
    assert fake_cuda.measure_calls == 2
    assert len(_cache_files(tmp_path)) == 2


def test_default_cache_dir_follows_the_environment(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    profile_hardware("cuda:0", progress=False)
    assert len(_cache_files(tmp_path / "explicit")) == 1

    monkeypatch.delenv("OFFLOAD_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "offload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "offload"


def test_force_remeasures_and_overwrites(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    profile_hardware("cuda:0", cache_dir=tmp_path, progress=False)
    (path,) = _cache_files(tmp_path)
    stale = dataclasses.replace(FAKE_PROFILE, compute_flop_per_s=1.0)
    path.write_text(stale.to_json())

    assert profile_hardware("cuda:0", cache_dir=tmp_path, progress=False) == stale
    assert fake_cuda.measure_calls == 1
    assert profile_hardware("cuda:0", cache_dir=tmp_path, force=True, progress=False) == (
        FAKE_PROFILE
    )
    assert fake_cuda.measure_calls == 2
    assert HardwareProfile.from_json(path.read_text()) == FAKE_PROFILE


def test_force_drops_the_shape_files_built_on_the_replaced_measurements(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    # A shape file copies the device-level measurements: once those are measured again,
    # a model whose shapes were cached gets its efficiency re-timed on the new ones
    # instead of reading the old measurements back.
    model_a, model_b = [(512, 1024, 4096)], [(64, 64, 64)]
    profile_hardware("cuda:0", cache_dir=tmp_path, matmul_shapes=model_a, progress=False)
    profile_hardware("cuda:0", cache_dir=tmp_path, matmul_shapes=model_b, progress=False)
    other_dtype = profile_hardware(
        "cuda:0", cache_dir=tmp_path, dtype=torch.bfloat16, matmul_shapes=model_a, progress=False
    )
    assert (fake_cuda.measure_calls, fake_cuda.efficiency_calls) == (2, 3)
    assert len(_cache_files(tmp_path)) == 5

    profile_hardware("cuda:0", cache_dir=tmp_path, force=True, progress=False)
    assert fake_cuda.measure_calls == 3
    # The float16 device-level file and the two bfloat16 files are left.
    assert len(_cache_files(tmp_path)) == 3
    profile_hardware("cuda:0", cache_dir=tmp_path, matmul_shapes=model_a, progress=False)
    assert (fake_cuda.measure_calls, fake_cuda.efficiency_calls) == (3, 4)
    again = profile_hardware(
        "cuda:0", cache_dir=tmp_path, dtype=torch.bfloat16, matmul_shapes=model_a, progress=False
    )
    assert again == other_dtype
    assert (fake_cuda.measure_calls, fake_cuda.efficiency_calls) == (3, 4)


@pytest.mark.parametrize(
    "content",
    [
        b"{ this is not json",
        b"\xff\xfe\x00 binary garbage",
        b"[]",
        json.dumps({"schema_version": 999}).encode(),
        json.dumps({**json.loads(FAKE_PROFILE.to_json()), "compute_efficiency": 7.0}).encode(),
        b"",
    ],
)
def test_corrupt_cache_is_remeasured_with_a_warning(
    content: bytes, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    profile_hardware("cuda:0", cache_dir=tmp_path, progress=False)
    (path,) = _cache_files(tmp_path)
    path.write_bytes(content)

    with pytest.warns(UserWarning, match="unusable"):
        profile = profile_hardware("cuda:0", cache_dir=tmp_path, progress=False)
    assert profile == FAKE_PROFILE
    assert fake_cuda.measure_calls == 2
    assert HardwareProfile.from_json(path.read_text()) == FAKE_PROFILE


def test_unwritable_cache_warns_and_still_returns_the_profile(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file-not-a-folder"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not write"):
        profile = profile_hardware("cuda:0", cache_dir=blocker, progress=False)
    assert profile == FAKE_PROFILE


def test_matmul_shapes_reuse_the_device_measurements(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    shapes = [(512, 1024, 4096), (512, 4096, 1024), (512, 1024, 4096)]
    profile = profile_hardware("cuda:0", cache_dir=tmp_path, matmul_shapes=shapes, progress=False)
    assert profile == dataclasses.replace(FAKE_PROFILE, compute_efficiency=FAKE_EFFICIENCY)
    assert (fake_cuda.measure_calls, fake_cuda.efficiency_calls) == (1, 1)
    assert len(_cache_files(tmp_path)) == 2

    # The same multiset of shapes in another order is the same cache entry.
    again = profile_hardware(
        "cuda:0", cache_dir=tmp_path, matmul_shapes=shapes[::-1], progress=False
    )
    assert again == profile
    assert (fake_cuda.measure_calls, fake_cuda.efficiency_calls) == (1, 1)

    # Another model's shapes cost only the matmul timing, not a new device sweep.
    profile_hardware("cuda:0", cache_dir=tmp_path, matmul_shapes=[(64, 64, 64)], progress=False)
    assert (fake_cuda.measure_calls, fake_cuda.efficiency_calls) == (1, 2)
    assert len(_cache_files(tmp_path)) == 3

    # Without shapes, the device-level file answers, with the default efficiency.
    plain = profile_hardware("cuda:0", cache_dir=tmp_path, progress=False)
    assert plain.compute_efficiency == DEFAULT_COMPUTE_EFFICIENCY
    assert fake_cuda.measure_calls == 1


def test_attention_rates_are_measured_once_per_model_shape_and_cached(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's attention rates live in its shapes' file: every later plan of the model on
    the machine reads the same rates instead of timing attention again."""
    timed: list[AttentionShape] = []

    def measure(device: object, shape: AttentionShape, **kwargs: object) -> tuple[float, float]:
        timed.append(shape)
        return 300e12, 200e12

    monkeypatch.setattr(hw_profile, "measure_attention_at", measure)
    matmuls = [(512, 1024, 4096)]
    attention = [AttentionShape(8, 25, 1024, 64, 0.0, calls=48)]

    def profile() -> HardwareProfile:
        return profile_hardware(
            "cuda:0",
            cache_dir=tmp_path,
            matmul_shapes=matmuls,
            attention_shapes=attention,
            progress=False,
        )

    first = profile()
    assert timed == attention
    assert first.attention_fwd_flop_per_s == pytest.approx(300e12)
    assert first.attention_bwd_flop_per_s == pytest.approx(200e12)
    assert first.compute_efficiency == FAKE_EFFICIENCY
    assert profile() == first and len(timed) == 1  # from the cache: nothing timed again
    # The matrix shapes alone are another file, without attention's rates.
    plain = profile_hardware("cuda:0", cache_dir=tmp_path, matmul_shapes=matmuls, progress=False)
    assert plain.attention_fwd_flop_per_s == 0 and len(timed) == 1
    # Another attention shape is timed into a file of its own.
    attention = [AttentionShape(8, 25, 512, 64, 0.0, calls=48)]
    profile()
    assert len(timed) == 2 and len(_cache_files(tmp_path)) == 4


def test_progress_lines_go_to_stderr_only_when_asked(
    fake_cuda: FakeCuda, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile_hardware("cuda:0", cache_dir=tmp_path, progress=False)
    profile_hardware("cuda:0", cache_dir=tmp_path, force=True, progress=False)
    quiet = capsys.readouterr()
    assert quiet.out == quiet.err == ""

    profile_hardware("cuda:0", cache_dir=tmp_path, force=True, progress=True)
    loud = capsys.readouterr()
    assert loud.out == ""
    assert "profiling NVIDIA Fake GPU" in loud.err
    assert "cached at" in loud.err


# ---------------------------------------------------------------------------- identity


def test_cache_key_is_file_name_safe_and_names_the_device() -> None:
    key = FAKE_IDENTITY.cache_key
    assert re.fullmatch(r"[A-Za-z0-9._-]+", key)
    assert "NVIDIA_Fake_GPU_80GB" in key
    assert "0123abcd" in key
    assert "torch2.11.0_cu130" in key
    other_card = dataclasses.replace(FAKE_IDENTITY, uuid="GPU-ffff")
    assert other_card.cache_key != key
    newer_torch = dataclasses.replace(FAKE_IDENTITY, torch_version="2.13.0")
    assert newer_torch.cache_key != key
    no_uuid = dataclasses.replace(FAKE_IDENTITY, uuid=None)
    assert "00000000_01_00.0" in no_uuid.cache_key


def test_cpu_identity_is_stable() -> None:
    first, second = device_identity("cpu"), device_identity("cpu")
    assert first == second
    assert first.device_type == "cpu"
    assert first.name
    assert first.total_memory_bytes >= 0
    assert re.fullmatch(r"[A-Za-z0-9._-]+", first.cache_key)


def test_host_memory_readings_are_consistent() -> None:
    total = hardware.total_host_memory_bytes()
    available = hardware.available_host_memory_bytes()
    assert total > 0
    assert 0 < available <= total


# ---------------------------------------------------------------------------- host Adam


def test_host_adam_throughput_is_a_positive_rate() -> None:
    rate = measure_host_adam_params_per_s(1 << 18, steps=2)
    assert 0 < rate < math.inf


def test_host_adam_median_keeps_the_middle_read_quietly_when_reads_agree() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_adam_median([4.1e9, 4.6e9, 4.3e9]) == 4.3e9
        assert host_adam_median([3.2e9]) == 3.2e9


def test_host_adam_median_warns_when_reads_disagree() -> None:
    # One read below the others by more than HOST_ADAM_READS_SPREAD is dropped, and told.
    with pytest.warns(
        RuntimeWarning, match=r"profile_hardware\(device, dtype=\.\.\., force=True\)"
    ):
        assert host_adam_median([1.4e9, 4.4e9, 4.1e9]) == 4.1e9
    assert hardware.HOST_ADAM_READS_SPREAD * 1.4 < 4.4


@pytest.mark.parametrize("reads", [[], [0.0, 4e9], [float("nan")], [-1.0, 2.0, 3.0]])
def test_host_adam_median_rejects_bad_reads(reads: list[float]) -> None:
    with pytest.raises(ValueError, match="positive and finite"):
        host_adam_median(reads)


def test_copy_contention_needs_cuda_and_sizes() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        measure_host_copy_contention(torch.device("cpu"), 1 << 10)
    with pytest.raises(ValueError, match="numel"):
        measure_host_copy_contention(torch.device("cpu"), 0)


def test_host_adam_rejects_empty_sizes() -> None:
    with pytest.raises(ValueError, match="numel"):
        measure_host_adam_params_per_s(0)
    with pytest.raises(ValueError, match="settle_s"):
        measure_host_adam_params_per_s(1 << 10, settle_s=-1.0)


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_profile_is_measured_plausibly_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not torch.cuda.is_available():
        pytest.fail("this test is marked gpu: run it on a machine with CUDA")
    shapes = [(512, 1024, 4096), (512, 4096, 1024), (512, 1024, 3072)]

    profile = profile_hardware(
        "cuda", cache_dir=tmp_path, force=True, matmul_shapes=shapes, progress=True
    )
    # Every probe filled its field with a measurement (how fast is the machine's, not the
    # test's): a positive finite rate, fractions in their ranges, the sweep's sizes.
    sizes = [p.size_bytes for p in profile.h2d]
    assert sizes == list(hardware.SWEEP_SIZES_BYTES[: len(sizes)])  # those that fit
    assert [p.size_bytes for p in profile.d2h] == sizes
    rates = [p.bytes_per_s for p in (*profile.h2d, *profile.d2h)] + [
        profile.compute_flop_per_s,
        profile.host_adam_params_per_s,
        profile.device_adam_params_per_s,
        profile.host_convert_elems_per_s,
        profile.device_memory_bytes_per_s,
        profile.host_memory_bytes_per_s,
        profile.op_overhead_s,
    ]
    assert all(0 < r < math.inf for r in rates), rates
    assert 0 < profile.compute_efficiency <= 1
    assert 0 < profile.host_copy_contention <= 1
    _free, total = torch.cuda.mem_get_info()
    assert profile.device_memory_bytes == total

    identity = device_identity("cuda")
    assert identity.name and identity.total_memory_bytes > 0
    files = _cache_files(tmp_path)
    assert len(files) == 2
    assert all(identity.cache_key in f.name for f in files)

    # The second call is answered from the cache, without measuring.
    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured although the profile is cached")

    monkeypatch.setattr(hw_profile, "measure_hardware", no_measuring)
    monkeypatch.setattr(hw_profile, "measure_matmul_efficiency", no_measuring)
    again = profile_hardware("cuda", cache_dir=tmp_path, matmul_shapes=shapes, progress=False)
    assert again == profile


# ---------------------------------------------------------------------------- host conversion


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_host_conversion_rate_is_a_positive_rate(dtype: torch.dtype) -> None:
    rate = measure_host_convert_elems_per_s(1 << 20, dtype=dtype, reps=2)
    assert 0 < rate < math.inf


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"numel": 0}, "numel"), ({"reps": 0}, "reps"), ({"dtype": torch.float64}, "float64")],
)
def test_host_conversion_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        measure_host_convert_elems_per_s(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- host memory


def test_host_memory_bandwidth_is_a_positive_rate() -> None:
    # 4 MiB buffers: small enough for a test, so this reads caches as much as DRAM; what
    # is checked is that the probe times a copy and counts its bytes, not the machine.
    rate = measure_host_memory_bytes_per_s(1 << 20, reps=2)
    assert 0 < rate < math.inf


@pytest.mark.parametrize(("kwargs", "match"), [({"numel": 0}, "numel"), ({"reps": 0}, "reps")])
def test_host_memory_bandwidth_rejects_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        measure_host_memory_bytes_per_s(**kwargs)


# ---------------------------------------------------------------------------- issue cost


def test_op_overhead_is_a_positive_time_on_the_cpu() -> None:
    overhead = measure_op_overhead_s("cpu", layers=1, reps=2)
    assert 0 < overhead < math.inf


# ---------------------------------------------------------------------------- attention


def test_attention_rates_count_what_the_flop_counter_counts_over_the_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A clock that makes each timed forward take 1 s and each forward and backward 3 s:
    # the rates are the FLOPs counted (on the CPU, whose fused kernel the counter does not
    # count, the flash kernel's formulas) over 1 s forward and 2 s backward.
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    reps = 3
    reads = itertools.count()

    def perf_counter() -> float:
        n = next(reads)  # two reads a timed call: forward's first, then both passes'
        return float(n // 2 * 4 + (n % 2) * (1 if n < 2 * reps else 3))

    monkeypatch.setattr(probes, "time", types.SimpleNamespace(perf_counter=perf_counter))
    shape = (2, 2, 64, 16)
    fwd, bwd = measure_attention_flop_per_s("cpu", batch=2, heads=2, seq=64, head_dim=16, reps=reps)
    assert fwd == sdpa_flop_count(shape, shape, shape)
    assert bwd == sdpa_backward_flop_count(shape, shape, shape, shape) / 2


def test_attention_rates_reject_an_empty_shape() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        measure_attention_flop_per_s("cpu", batch=1, heads=1, seq=8, head_dim=0)
    with pytest.raises(ValueError, match="dropout_p"):
        measure_attention_flop_per_s("cpu", batch=1, heads=1, seq=8, head_dim=8, dropout_p=1.0)


def test_op_overhead_rejects_an_empty_graph() -> None:
    with pytest.raises(ValueError, match="layers"):
        measure_op_overhead_s("cpu", layers=0)


def test_issue_cost_graph_counts_operations_as_the_tracer_does() -> None:
    # The cost is divided per traced operation, so the graph must count operations at the
    # granularity of offload_trace's profiles: per block, the same number. (Each trace
    # also has a fixed few bookkeeping nodes, hence the difference of two depths.)
    from offload_trace import trace

    counts = {}
    traced = {}
    for layers in (1, 2):
        graph, counts[layers] = issue_cost.issue_cost_graph(
            layers, torch.float32, torch.device("cpu")
        )
        example = (torch.randn(2, 8, issue_cost.ISSUE_COST_HIDDEN),)
        profile = trace(graph, example, dtype=torch.float32, target_device="cpu").to_profile()
        traced[layers] = len(profile.operations)
    per_block = counts[2] - counts[1]
    assert per_block == traced[2] - traced[1]
    # A GPT-2 block as traced from transformers has about 40 operations: this one too.
    assert 35 <= per_block <= 45


def test_device_memory_rate_needs_a_cuda_device_and_sane_arguments() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        measure_device_memory_bytes_per_s(torch.device("cpu"))
    with pytest.raises(ValueError, match="must be >= 1"):
        measure_device_memory_bytes_per_s(torch.device("cuda"), size_bytes=0)
