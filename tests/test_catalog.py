"""GPU catalog: datasheet figures, NVML name mapping, lookups and registration."""

from __future__ import annotations

import dataclasses

import pytest

from gogh_flows import catalog
from gogh_flows.catalog import (
    CATALOG,
    GpuType,
    UnknownGpuTypeError,
    from_nvml_name,
    get_gpu_type,
    gpu_types,
    register_gpu_type,
)

BUILTIN_NAMES = ("a10", "a100", "a40", "h100", "k80", "l4", "p100", "t4", "v100")


@pytest.fixture
def clean_registry():
    """Restore the run-time registry after a test that registers types."""
    saved = dict(catalog._registered)
    yield
    catalog._registered.clear()
    catalog._registered.update(saved)


def _custom(**overrides) -> GpuType:
    fields = dict(
        name="rtx4090",
        display_name="NVIDIA GeForce RTX 4090",
        architecture="Ada Lovelace",
        fp32_tflops=82.6,
        fp16_tflops=165.2,
        memory_gb=24,
        memory_bandwidth_gbs=1008,
        tdp_w=450,
        idle_w=20,
        has_energy_counter=True,
        nvml_patterns=("rtx 4090",),
    )
    fields.update(overrides)
    return GpuType(**fields)


def test_all_nine_builtins_present_with_sane_figures():
    assert tuple(sorted(CATALOG)) == BUILTIN_NAMES
    assert tuple(g.name for g in gpu_types()) == BUILTIN_NAMES
    for gpu in CATALOG.values():
        for field in ("fp32_tflops", "fp16_tflops", "memory_gb", "memory_bandwidth_gbs", "tdp_w", "idle_w"):
            assert getattr(gpu, field) > 0, (gpu.name, field)
        assert gpu.idle_w < gpu.tdp_w
        assert gpu.dynamic_range_w == pytest.approx(gpu.tdp_w - gpu.idle_w)
        assert gpu.fp16_tflops >= gpu.fp32_tflops
        assert gpu.nvml_patterns


def test_catalog_is_read_only():
    with pytest.raises(TypeError):
        CATALOG["x"] = CATALOG["v100"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        CATALOG["v100"].tdp_w = 1  # type: ignore[misc]


def test_datasheet_spot_checks():
    v100, h100, a100, l4 = (CATALOG[n] for n in ("v100", "h100", "a100", "l4"))
    assert v100.fp32_tflops == 15.7 and v100.fp16_tflops == 125 and v100.memory_bandwidth_gbs == 900
    assert h100.memory_gb == 80 and h100.fp16_tflops == 989 and h100.tdp_w == 700
    assert a100.memory_bandwidth_gbs == 2039 and a100.fp16_tflops == 312
    assert l4.fp16_tflops == 121 and l4.tdp_w == 72
    assert h100.memory_bytes == 80 * 10**9


def test_k80_is_one_die_half_a_board():
    k80 = CATALOG["k80"]
    assert k80.memory_gb == 12
    assert k80.memory_bandwidth_gbs == 240
    assert k80.fp32_tflops == pytest.approx(8.73 / 2)
    assert k80.fp16_tflops == k80.fp32_tflops
    assert k80.tdp_w == 150


@pytest.mark.parametrize("name", ["k80", "p100"])
def test_no_energy_counter_before_volta(name):
    assert CATALOG[name].has_energy_counter is False


@pytest.mark.parametrize("name", ["v100", "t4", "a10", "l4", "a100", "h100"])
def test_energy_counter_from_volta_on(name):
    assert CATALOG[name].has_energy_counter is True


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("Tesla K80", "k80"),
        ("Tesla P100-PCIE-16GB", "p100"),
        ("Tesla P100-SXM2-16GB", "p100"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("Tesla V100-PCIE-16GB", "v100"),
        ("Tesla V100S-PCIE-32GB", "v100"),
        ("Tesla T4", "t4"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA A10G", "a10"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-SXM4-40GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA A100-PCIE-40GB", "a100"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H100 NVL", "h100"),
        (b"Tesla V100-SXM2-16GB", "v100"),
        (b"NVIDIA A100-SXM4-40GB", "a100"),
    ],
)
def test_from_nvml_name(device_name, expected):
    assert from_nvml_name(device_name).name == expected


@pytest.mark.parametrize("device_name", ["NVIDIA L40S", "NVIDIA L40", "NVIDIA GeForce RTX 4090", ""])
def test_unknown_nvml_name_says_how_to_add_it(device_name):
    with pytest.raises(UnknownGpuTypeError) as info:
        from_nvml_name(device_name)
    message = str(info.value)
    assert repr(device_name) in message
    assert "register_gpu_type" in message
    assert "nvml_patterns" in message
    assert "a10, a100, a40, h100" in message


def test_get_gpu_type_is_case_and_space_insensitive():
    assert get_gpu_type("V100") is CATALOG["v100"]
    assert get_gpu_type("  h100 ") is CATALOG["h100"]


def test_get_gpu_type_unknown_lists_known_names():
    with pytest.raises(UnknownGpuTypeError) as info:
        get_gpu_type("x100")
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, ValueError)
    message = str(err)
    assert message.startswith("unknown GPU type 'x100'")  # not repr-quoted like a plain KeyError
    assert "known types: a10, a100, a40, h100, k80, l4, p100, t4, v100." in message
    assert "register_gpu_type" in message
    with pytest.raises(ValueError, match="x100"):
        get_gpu_type("x100")
    with pytest.raises(KeyError):
        get_gpu_type("x100")


def test_register_makes_type_known_everywhere(clean_registry):
    custom = _custom()
    register_gpu_type(custom)
    assert get_gpu_type("RTX4090") is custom
    assert from_nvml_name("NVIDIA GeForce RTX 4090") is custom
    assert custom in gpu_types()
    assert [g.name for g in gpu_types()] == sorted(g.name for g in gpu_types())
    assert "rtx4090" not in CATALOG  # the builtin view stays unchanged


def test_register_existing_name_needs_replace(clean_registry):
    register_gpu_type(_custom())
    with pytest.raises(ValueError, match="rtx4090"):
        register_gpu_type(_custom(tdp_w=400))
    with pytest.raises(ValueError, match="v100"):
        register_gpu_type(dataclasses.replace(CATALOG["v100"], tdp_w=250))
    register_gpu_type(_custom(tdp_w=400), replace=True)
    assert get_gpu_type("rtx4090").tdp_w == 400
    tuned = dataclasses.replace(CATALOG["v100"], memory_gb=32)
    register_gpu_type(tuned, replace=True)
    assert get_gpu_type("v100") is tuned
    assert from_nvml_name("Tesla V100-SXM2-32GB") is tuned
    assert CATALOG["v100"].memory_gb == 16


def test_longer_registered_pattern_wins(clean_registry):
    l40s = _custom(name="l40s", nvml_patterns=("l40s",), tdp_w=350)
    register_gpu_type(l40s)
    assert from_nvml_name("NVIDIA L40S") is l40s
    assert from_nvml_name("NVIDIA L4").name == "l4"


def test_registry_fixture_cleans_up():
    assert "rtx4090" not in {g.name for g in gpu_types()}
    assert get_gpu_type("v100") is CATALOG["v100"]


@pytest.mark.parametrize(
    ("overrides", "field", "bad"),
    [
        ({"fp32_tflops": 0}, "fp32_tflops", "0"),
        ({"memory_gb": -1}, "memory_gb", "-1"),
        ({"memory_bandwidth_gbs": float("nan")}, "memory_bandwidth_gbs", "nan"),
        ({"idle_w": 500}, "idle_w", "500"),
        ({"name": "RTX 4090"}, "name", "RTX 4090"),
        ({"name": ""}, "name", "''"),
    ],
)
def test_validation_names_field_and_value(overrides, field, bad):
    with pytest.raises(ValueError, match=field) as info:
        _custom(**overrides)
    assert bad in str(info.value)
