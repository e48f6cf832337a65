"""Workload features and the Gavel model zoo."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gogh_flows.workloads import (
    DEFAULT_BATCH_SIZES,
    FAMILIES,
    OP_KINDS,
    LayerFeature,
    WorkloadFeatures,
    build_model,
    extract_features,
    family_of,
    job_type_name,
    parse_job_type,
    zoo_features,
)


class _FunctionalAttention(nn.Module):
    """Attention written with torch.matmul: FLOPs outside any leaf module."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2)) * self.temperature
        return torch.matmul(scores.softmax(-1), x)


class _UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _FunctionalAttention()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.head(self.norm(self.attn(x))) * scale


def _counter_total(model: nn.Module, *args: torch.Tensor) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*args)
    return counter.get_total_flops()


# --------------------------------------------------------------------------- zoo


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_builds_on_meta_at_every_gavel_batch_size(family):
    built = build_model(family)
    assert built.family == family and built.batch_size == DEFAULT_BATCH_SIZES[family][0]
    assert all(p.is_meta for p in built.module.parameters())
    for bs in DEFAULT_BATCH_SIZES[family]:
        feats = zoo_features(family, bs)
        assert feats.batch_size == bs and feats.kind == "training"
        assert len(feats.layers) > 0 and feats.forward_flops > 0 and feats.params > 0
        assert all(layer.op in OP_KINDS for layer in feats.layers)
        assert feats.memory_bytes_estimate > feats.param_bytes > 0
        assert feats.step_bytes_moved > 0


def test_flops_scale_linearly_with_batch_size():
    small, large = zoo_features("ResNet-18", 32), zoo_features("ResNet-18", 64)
    assert large.forward_flops / small.forward_flops == pytest.approx(2.0, rel=0.01)
    assert large.params == small.params


def test_resnet_sizes_match_the_papers():
    r50 = zoo_features("ResNet-50", 1)
    assert r50.forward_flops == pytest.approx(8.2e9, rel=0.10)  # 4.1 GMACs
    assert r50.params == pytest.approx(25.6e6, rel=0.05)
    assert zoo_features("ResNet-18", 16).params == pytest.approx(11.2e6, rel=0.05)


def test_lstm_language_model_has_rnn_layers_with_flops():
    feats = zoo_features("LM", 20)
    rnn = [layer for layer in feats.layers if layer.op == "rnn"]
    assert rnn and all(layer.flops > 0 for layer in rnn)
    # 2 layers x 4 gates x 2 FLOPs x 650 x (650 + 650) per token, 20 x 35 tokens
    assert sum(layer.flops for layer in rnn) == pytest.approx(2 * 4 * 2 * 650 * 1300 * 20 * 35)


def test_cyclegan_step_runs_two_generators_and_two_discriminators():
    feats = zoo_features("CycleGAN")
    prefixes = {layer.name.split(".")[0] for layer in feats.layers}
    assert prefixes == {"G_AB", "G_BA", "D_A", "D_B"}
    assert any(layer.op == "conv_transpose" for layer in feats.layers)


def test_zoo_models_train_for_real_on_cpu():
    for family in ("ResNet-18", "LM"):
        built = build_model(family, 2, device="cpu")
        out = built.module(*built.example_inputs)
        assert out.shape[0] == 2 and torch.isfinite(out).all()
        out.float().pow(2).mean().backward()
        grads = [p.grad for p in built.module.parameters()]
        assert all(g is not None for g in grads)


def test_zoo_lookups_are_case_insensitive_and_cached():
    assert zoo_features("resnet-50", 16) is zoo_features("ResNet-50", 16)
    assert build_model(" a3c ").family == "A3C"


# --------------------------------------------------------------------------- features


def test_layer_flops_add_up_to_the_counter_including_functional_matmuls():
    model, x = _UserModel(), torch.randn(4, 5, 16)
    feats = extract_features(model, x)
    assert feats.forward_flops == _counter_total(model, x) > 0
    functional = [layer for layer in feats.layers if layer.name == "attn.(functional)"]
    assert len(functional) == 1 and functional[0].op == "matmul"
    assert functional[0].flops == 2 * (2 * 4 * 5 * 5 * 16)  # two (5x16)@(16x5)-ish matmuls
    assert functional[0].params == 1  # the temperature lives on the container
    assert feats.params == sum(p.numel() for p in model.parameters())


def test_user_model_with_kwargs_is_left_untouched():
    model = _UserModel().eval()
    feats = extract_features(model, {"x": torch.randn(8, 5, 16), "scale": 2.0})
    assert feats.batch_size == 8 and feats.kind == "training"
    assert [layer.name for layer in feats.layers][:2] == ["attn.q", "attn.k"]
    assert not model.training  # mode restored
    assert all(p.device.type == "cpu" for p in model.parameters())  # ran on a meta copy


def test_running_in_place_matches_meta_for_fused_cpu_kernels():
    # On CPU, LSTM and eval-mode attention use fused kernels the counter cannot see.
    lstm = nn.Sequential(nn.LSTM(32, 48, num_layers=2, batch_first=True))
    x = torch.randn(3, 7, 32)
    assert extract_features(lstm, x, device=None).forward_flops == extract_features(lstm, x).forward_flops
    mha = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2).eval()
    on_cpu = extract_features(mha, x, kind="inference", device=None)
    assert on_cpu.forward_flops == extract_features(mha, x, kind="inference").forward_flops
    assert torch.backends.mha.get_fastpath_enabled()  # flag restored


def test_inference_step_is_a_third_of_training():
    train, infer = zoo_features("ResNet-18", 64), zoo_features("ResNet-18", 64, kind="inference")
    assert infer.step_flops == pytest.approx(train.step_flops / 3)
    assert infer.forward_flops == pytest.approx(train.forward_flops)
    assert infer.memory_bytes_estimate < train.memory_bytes_estimate
    assert infer.step_bytes_moved < train.step_bytes_moved


def test_memory_estimate_is_plausible():
    r50 = zoo_features("ResNet-50", 64)
    assert 1e9 < r50.memory_bytes_estimate < 40e9
    # in-place ReLUs and Identity shortcuts add no activation memory
    assert all(layer.activation_bytes == 0 for layer in r50.layers if layer.op == "activation")


def test_features_round_trip_through_json():
    feats = zoo_features("Transformer", 16)
    again = WorkloadFeatures.from_dict(json.loads(json.dumps(feats.to_dict())))
    assert again == feats and again.step_flops == feats.step_flops


# --------------------------------------------------------------------------- job types


def test_job_type_names_round_trip_for_gavel_batch_sizes():
    for family in FAMILIES:
        for bs in DEFAULT_BATCH_SIZES[family]:
            name = job_type_name(family, bs)
            assert parse_job_type(name) == (family, bs)
            assert family_of(name) == family
    assert job_type_name("ResNet-50", 64) == "ResNet-50 (batch size 64)"
    assert job_type_name("A3C", 20) == "A3C" and parse_job_type("A3C") == ("A3C", 20)
    assert parse_job_type("CycleGAN") == ("CycleGAN", 1)
    assert parse_job_type("lm (batch size 5)") == ("LM", 5)
    assert parse_job_type(job_type_name("A3C", 40)) == ("A3C", 40)  # non-Gavel sizes stay distinct


@pytest.mark.parametrize("typed", ["LM (batch size20)", "LM (batchsize 20)", "LM (batch 20)"])
def test_a_mistyped_job_type_name_is_told_its_form_not_called_an_unknown_family(typed):
    """`gogh predict --job "LM (batch size20)"` said "unknown model family 'LM (batch size20)'" and
    listed every family (a new user's walk-through of the user guide)."""
    with pytest.raises(ValueError, match=r"cannot read the job type .*write it as 'FAMILY \(batch size N\)', "
                                         r"e\.g\. 'LM \(batch size 20\)'$"):
        parse_job_type(typed)


def test_inference_job_types_are_named_apart_and_round_trip():
    from gogh_flows.workloads.zoo import parse_job_kind

    name = job_type_name("ResNet-50", 64, "inference")
    assert name == "ResNet-50 (batch size 64) [inference]" != job_type_name("ResNet-50", 64)
    assert parse_job_kind(name) == ("ResNet-50", 64, "inference")
    assert parse_job_kind(job_type_name("A3C", 20, "inference")) == ("A3C", 20, "inference")
    assert parse_job_kind("LM (batch size 20)") == ("LM", 20, "training")
    assert parse_job_type(name) == ("ResNet-50", 64) and family_of(name) == "ResNet-50"
    with pytest.raises(ValueError, match="kind"):
        job_type_name("LM", 20, "serving")


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call", [
    lambda: build_model("AlexNet"),
    lambda: zoo_features("AlexNet"),
    lambda: parse_job_type("AlexNet (batch size 3)"),
    lambda: family_of("BERT"),
])
def test_unknown_family_lists_the_families(call):
    with pytest.raises(ValueError, match="unknown model family") as info:
        call()
    assert all(family in str(info.value) for family in FAMILIES)
    assert "case-insensitive" in str(info.value)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64", True])
def test_bad_batch_size_is_named(bad):
    with pytest.raises(ValueError, match="batch_size"):
        build_model("ResNet-18", bad)
    with pytest.raises(ValueError, match="batch_size"):
        job_type_name("ResNet-18", bad)


def test_bad_kind_is_named():
    with pytest.raises(ValueError, match="kind"):
        zoo_features("A3C", kind="finetune")
    with pytest.raises(ValueError, match="kind"):
        extract_features(nn.Linear(2, 2), torch.randn(1, 2), kind="eval")


def test_failing_forward_says_so_and_chains_the_cause():
    model = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="forward pass .* on the example input failed") as info:
        extract_features(model, torch.randn(2, 5))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "device=None" in str(info.value)


def test_batch_size_needs_a_batched_tensor():
    with pytest.raises(ValueError, match="batch_size"):
        extract_features(nn.Identity(), torch.tensor(1.0))
    # features are traced on the example batch: one of another size would be labelled wrongly
    with pytest.raises(ValueError, match=r"no dimension of batch_size=3 \(shapes \[\(6, 2\)\]\).*\(6\?\)"):
        extract_features(nn.Linear(2, 2), torch.randn(6, 2), batch_size=3)
    # a sequence-first model takes its batch second: that is the batch the label names
    feats = extract_features(nn.LSTM(4, 8), torch.randn(10, 3, 4), batch_size=3)
    assert feats.batch_size == 3


def test_gogh_placed_refuses_example_inputs_of_another_batch_size():
    from gogh_flows import gogh_placed

    with pytest.raises(ValueError, match=r"@gogh_placed\(example_inputs=\.\.\., batch_size=4\): .*batch of 4 inputs"):
        gogh_placed(model=nn.Sequential(nn.Linear(8, 4)), example_inputs=torch.randn(16, 8), batch_size=4,
                    min_throughput=1.0, work_steps=10)


def test_invalid_feature_records_are_rejected():
    with pytest.raises(ValueError, match="op"):
        LayerFeature(name="x", op="fft", flops=1.0, params=0, activation_bytes=0, input_bytes=0)
    with pytest.raises(ValueError, match="kind"):
        WorkloadFeatures(layers=(), batch_size=1, kind="serving")


@pytest.mark.parametrize("family, batch_size", [("ResNet-18", 48), ("Transformer", 64), ("LM", 20),
                                                ("Recommendation", 1024), ("CycleGAN", 3), ("A3C", 20)])
def test_rescaled_zoo_features_equal_a_real_extraction(family, batch_size):
    """zoo_features interpolates two reference passes; it must match a pass at that batch size."""
    from gogh_flows.workloads import build_model, extract_features, zoo_features

    built = build_model(family, batch_size)
    direct = extract_features(built.module, built.example_inputs, batch_size=batch_size)
    scaled = zoo_features(family, batch_size)
    assert scaled.batch_size == direct.batch_size
    assert [layer.name for layer in scaled.layers] == [layer.name for layer in direct.layers]
    for a, b in zip(scaled.layers, direct.layers):
        assert a.flops == pytest.approx(b.flops, rel=1e-9)
        assert a.params == b.params
        assert a.activation_bytes == pytest.approx(b.activation_bytes, abs=1)
        assert a.input_bytes == pytest.approx(b.input_bytes, abs=1)


def test_zoo_reference_features_are_kept_on_disk_and_equal_a_fresh_extraction(tmp_path, monkeypatch):
    """Read back exactly; a corrupt file is extracted again; another zoo version has a key of its own."""
    from gogh_flows.workloads import build_model, extract_features
    from gogh_flows.workloads import feature_cache, zoo

    monkeypatch.setenv(feature_cache.CACHE_ENV, str(tmp_path))
    calls = []

    def extract():
        calls.append(1)
        built = build_model("A3C", 4, device="meta")
        return extract_features(built.module, built.example_inputs, batch_size=4)

    first = feature_cache.cached_features("A3C-4-training", extract, batch_size=4, kind="training")
    (path,) = tmp_path.glob("zoo-features-*/A3C-4-training.json")
    assert feature_cache.cached_features("A3C-4-training", extract, batch_size=4, kind="training") == first and len(calls) == 1
    zoo._zoo_reference.cache_clear()
    assert zoo._zoo_reference("A3C", 4, "training") == first and len(calls) == 1  # the zoo reads it too
    path.write_text("{not json")
    assert feature_cache.cached_features("A3C-4-training", extract, batch_size=4, kind="training") == first and len(calls) == 2
    assert feature_cache.cached_features("A3C-4-training", lambda: first, batch_size=4, kind="training") == first and len(calls) == 2  # rewritten
    (path.parent / "A3C-8-training.json").write_text(path.read_text())  # a batch-4 file under a batch-8 name
    assert feature_cache.cached_features("A3C-8-training", extract, batch_size=8, kind="training") == first
    assert len(calls) == 3  # not taken for batch 8: extracted (here by the batch-4 extractor) and rewritten
    monkeypatch.setattr(feature_cache, "_version", lambda: "another-zoo")
    feature_cache.cached_features("A3C-4-training", extract, batch_size=4, kind="training")
    assert len(calls) == 4 and (tmp_path / "zoo-features-another-zoo" / "A3C-4-training.json").exists()
    zoo._zoo_reference.cache_clear()


def test_a_negative_batch_size_in_a_job_type_is_named_as_such():
    """`gogh predict --job "ResNet-50 (batch size -4)"` said "unknown model family 'ResNet-50 (batch
    size -4)'" while batch size 0 said what was wrong."""
    from gogh_flows.workloads.zoo import parse_job_kind

    for bad in ("ResNet-50 (batch size -4)", "ResNet-50 (batch size 0)"):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            parse_job_kind(bad)
    assert parse_job_kind("ResNet-50 (batch size 64)") == ("ResNet-50", 64, "training")


def test_a_mistyped_family_is_answered_with_the_families_meant_everywhere_it_is_read():
    """`gogh predict --job "ResNet50 (batch size 64)"` listed every family and batch size but not
    the one meant, where the decorator said "did you mean" (a new-user review)."""
    from gogh_flows.workloads.job import JobSpec
    from gogh_flows.workloads.zoo import canonical_family, families_like

    assert families_like("ResNet50") == ["ResNet-18", "ResNet-50"]
    assert families_like("transfomer") == ["Transformer"]
    assert families_like("zzz") == [] and families_like("  ") == []
    with pytest.raises(ValueError, match=r"unknown model family 'ResNet50' \(did you mean 'ResNet-18' or 'ResNet-50'\?\)"):
        canonical_family("ResNet50")
    with pytest.raises(ValueError, match=r"'Transfomer' \(did you mean 'Transformer'\?\).*JobSpec.from_model"):
        JobSpec(name="t", family="Transfomer", batch_size=16, required_throughput=1.0, work_steps=10)
