import pytest
import torch
from pydantic import ValidationError

from gogh_flows.workloads.job import JobSpec


def test_zoo_job_gets_features_and_gavel_job_type():
    spec = JobSpec.from_zoo("resnet-50", 64, required_throughput=3.5, work_steps=20_000)
    assert spec.family == "ResNet-50"
    assert spec.job_type == "ResNet-50 (batch size 64)"
    assert spec.features is not None and spec.features.batch_size == 64
    assert 1 < spec.memory_gb < 40


def test_zoo_inference_job_has_its_own_job_type_and_features():
    train = JobSpec.from_zoo("ResNet-50", 64, required_throughput=3.5, work_steps=10)
    infer = JobSpec.from_zoo("ResNet-50", 64, kind="inference", required_throughput=3.5, work_steps=10)
    assert infer.job_type == "ResNet-50 (batch size 64) [inference]" != train.job_type
    assert infer.features.step_flops < train.features.step_flops


def test_user_model_job():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    spec = JobSpec.from_model("my-mlp", model, torch.randn(16, 64), required_throughput=100.0, work_steps=1000)
    assert spec.batch_size == 16 and spec.job_type == "my-mlp" and spec.family is None
    assert spec.features.forward_flops > 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(required_throughput=0), "required_throughput"),
        (dict(required_throughput=-2.0), "required_throughput"),
        (dict(required_throughput=float("inf")), "required_throughput"),
        (dict(work_steps=0), "work_steps"),
        (dict(num_gpus=3), "num_gpus"),
        (dict(kind="finetune"), "kind"),
        (dict(family="AlexNet"), "family"),
        (dict(name=""), "name"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    base = dict(name="j", family="ResNet-18", batch_size=32, required_throughput=1.0, work_steps=10)
    base.update(kwargs)
    with pytest.raises(ValidationError) as info:
        JobSpec(**base)
    assert field in str(info.value)


def test_job_that_fits_no_gpu_is_refused_with_the_numbers():
    with pytest.raises(ValidationError, match=r"needs about .* GB .* largest, a100, h100, have 80 GB"):
        JobSpec.from_zoo("ResNet-50", 8192, required_throughput=1.0, work_steps=10)
