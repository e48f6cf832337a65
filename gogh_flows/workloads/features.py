"""Per-layer features of any torch model at a given batch size.

Why: GOGH's throughput predictor is a recurrent network that reads a job as the
sequence of its layers, and the synthetic fleet prices each layer with a
roofline model.  Both need, per layer and for the whole batch, the forward
FLOPs, the parameters and the bytes the layer reads and writes.

How: one forward pass of the model on the example input, by default on the
``meta`` device so that even ResNet-50 at batch 256 allocates nothing and
costs milliseconds.  FLOPs come from torch's own
:class:`torch.utils.flop_counter.FlopCounterMode` (a multiply-add is 2 FLOPs;
only matmul-like ops -- mm, addmm, bmm, convolutions, attention -- carry FLOPs,
so norms, activations, pooling and embeddings get 0 FLOPs but real bytes).
Forward hooks split the counter's running total per module *call*: a layer's
FLOPs are the growth of the total between its pre- and post-hook.  That keeps
the layers in execution order, handles modules called several times (a shared
ReLU) and does not depend on how the counter's ``ModuleTracker`` names modules
(it prefixes the root's class name, e.g. ``"ResNet.layer1.0.conv1"``, and
names a shared module after the first path it saw).  FLOPs that happen in a
container's own ``forward`` (``torch.matmul`` in a hand-written attention)
become a synthetic ``"<parent>.(functional)"`` layer, so the layers' FLOPs
always add up to the counter's total.
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

OP_KINDS: tuple[str, ...] = (
    "conv", "conv_transpose", "linear", "matmul", "embedding", "rnn", "attention",
    "norm", "activation", "pool", "dropout", "other",
)
KINDS: tuple[str, ...] = ("training", "inference")

#: A training step is forward + backward; backward costs about twice the forward
#: (gradients w.r.t. activations and w.r.t. weights), hence 3x in FLOPs and bytes.
TRAINING_PASSES = 3
#: fp32 everywhere: features describe the job, not a mixed-precision recipe.
BYTES_PER_PARAM = 4
#: Adam-like update per parameter: read weight, grad, m, v and write weight, m, v.
OPTIMIZER_TRAFFIC_FACTOR = 7
#: Training keeps weight, grad and two optimizer moments per parameter.
TRAINING_STATE_FACTOR = 4
#: cuDNN/cuBLAS workspaces, allocator slack.
WORKSPACE_FRACTION = 0.10
FUNCTIONAL_SUFFIX = "(functional)"

_ACTIVATIONS = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.SiLU, nn.Softmax,
    nn.LogSoftmax, nn.ELU, nn.SELU, nn.CELU, nn.Mish, nn.Hardswish, nn.Hardsigmoid,
    nn.Hardtanh, nn.PReLU, nn.Softplus, nn.GLU,
)
_NORMS = (
    nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm,
)
#: Checked in order: ConvTranspose before Conv (both are ``_ConvNd``).
_OP_BY_TYPE: tuple[tuple[tuple[type, ...], str], ...] = (
    ((nn.modules.conv._ConvTransposeNd,), "conv_transpose"),
    ((nn.modules.conv._ConvNd,), "conv"),
    ((nn.Linear, nn.Bilinear), "linear"),
    ((nn.Embedding, nn.EmbeddingBag), "embedding"),
    ((nn.RNNBase, nn.RNNCellBase), "rnn"),
    ((nn.MultiheadAttention,), "attention"),
    (_NORMS, "norm"),
    (_ACTIVATIONS, "activation"),
    ((nn.modules.dropout._DropoutNd,), "dropout"),
)
_RNN_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_CELL_GATES = {nn.LSTMCell: 4, nn.GRUCell: 3, nn.RNNCell: 1}


@dataclass(frozen=True, slots=True)
class LayerFeature:
    """One layer call: what it computes and moves for the whole batch."""

    name: str  # module qualified name, e.g. "layer1.0.conv1"
    op: str  # one of OP_KINDS
    flops: float  # forward FLOPs for the whole batch (multiply-add = 2)
    params: int  # parameters owned by this layer (counted once per model)
    activation_bytes: int  # bytes of the new output tensor(s); 0 for in-place ops and views
    input_bytes: int  # bytes of the distinct input tensor(s)

    def __post_init__(self) -> None:
        if self.op not in OP_KINDS:
            raise ValueError(f"LayerFeature op must be one of {OP_KINDS}, got {self.op!r}")
        if not all(0 <= v < math.inf for v in (self.flops, self.params, self.activation_bytes, self.input_bytes)):
            raise ValueError(f"LayerFeature {self.name!r}: flops, params and bytes must be finite numbers >= 0; got "
                             f"flops={self.flops!r}, params={self.params!r}, "
                             f"activation_bytes={self.activation_bytes!r}, input_bytes={self.input_bytes!r}")
        object.__setattr__(self, "flops", float(self.flops))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "op": self.op, "flops": self.flops, "params": self.params,
            "activation_bytes": self.activation_bytes, "input_bytes": self.input_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerFeature:
        return cls(
            name=str(d["name"]), op=str(d["op"]), flops=float(d["flops"]), params=int(d["params"]),
            activation_bytes=int(d["activation_bytes"]), input_bytes=int(d["input_bytes"]),
        )


@dataclass(frozen=True, slots=True)
class WorkloadFeatures:
    """A job at one batch size: its layers in execution order plus derived totals."""

    layers: tuple[LayerFeature, ...]
    batch_size: int
    kind: str  # "training" or "inference"

    def __post_init__(self) -> None:
        check_kind(self.kind)
        object.__setattr__(self, "batch_size", check_batch_size(self.batch_size))
        object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def passes(self) -> int:
        """Forward-equivalents per step: 3 for training (fwd + bwd), 1 for inference."""
        return TRAINING_PASSES if self.kind == "training" else 1

    @property
    def forward_flops(self) -> float:
        return sum(layer.flops for layer in self.layers)

    @property
    def step_flops(self) -> float:
        return self.passes * self.forward_flops

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return BYTES_PER_PARAM * self.params

    @property
    def activation_bytes(self) -> int:
        return sum(layer.activation_bytes for layer in self.layers)

    @property
    def step_bytes_moved(self) -> float:
        """Estimated DRAM traffic of one step, assuming no reuse across layers.

        Each layer reads its inputs and weights and writes its outputs once per
        pass; training does 3 passes (like FLOPs) and then an Adam-like update
        that reads weight, grad and two moments and writes weight and two
        moments (``OPTIMIZER_TRAFFIC_FACTOR`` x param bytes).
        """
        per_pass = sum(
            layer.input_bytes + layer.activation_bytes + BYTES_PER_PARAM * layer.params
            for layer in self.layers
        )
        moved = float(self.passes * per_pass)
        if self.kind == "training":
            moved += OPTIMIZER_TRAFFIC_FACTOR * self.param_bytes
        return moved

    @property
    def memory_bytes_estimate(self) -> float:
        """Peak GPU memory of one step, plus ``WORKSPACE_FRACTION`` for workspaces.

        Training holds weights, grads and two optimizer moments (4x param bytes)
        and every layer output for the backward pass.  Inference holds the
        weights and, at worst, one layer's input and output at a time.
        """
        if self.kind == "training":
            need = TRAINING_STATE_FACTOR * self.param_bytes + self.activation_bytes
        else:
            widest = max((l.input_bytes + l.activation_bytes for l in self.layers), default=0)
            need = self.param_bytes + widest
        return need * (1.0 + WORKSPACE_FRACTION)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; :meth:`from_dict` inverts it."""
        return {
            "batch_size": self.batch_size,
            "kind": self.kind,
            "layers": [layer.to_dict() for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkloadFeatures:
        return cls(
            layers=tuple(LayerFeature.from_dict(x) for x in d["layers"]),
            batch_size=int(d["batch_size"]),
            kind=str(d["kind"]),
        )


def op_kind(module: nn.Module) -> str:
    """The op kind of a module, from its type (``"other"`` when unknown)."""
    for types, kind in _OP_BY_TYPE:
        if isinstance(module, types):
            return kind
    if "Pool" in type(module).__name__:
        return "pool"
    return "other"


def extract_features(
    model: nn.Module,
    example_inputs: Any,
    *,
    kind: str = "training",
    batch_size: int | None = None,
    device: str | torch.device | None = "meta",
) -> WorkloadFeatures:
    """Features of ``model`` on ``example_inputs`` from one forward pass.

    ``example_inputs`` is a tensor, a tuple of positional arguments or a dict of
    keyword arguments.  ``device="meta"`` (default) runs on a meta copy of the
    model and inputs, so nothing is allocated; ``device=None`` runs where the
    model and inputs already are (needed when ``forward`` reads tensor values,
    e.g. ``.item()``).  The caller's model is left in its original train/eval mode.
    """
    check_kind(kind)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    bs = _batch_size(example_inputs) if batch_size is None else check_batch_size(batch_size)
    if batch_size is not None:
        check_example_batch(example_inputs, bs)
    run_model, run_inputs = _on_device(model, example_inputs, device)
    args, kwargs = _as_call(run_inputs)
    on_meta = device is not None and torch.device(device).type == "meta"
    layers = _trace_layers(run_model, args, kwargs, training=kind == "training", on_meta=on_meta)
    return WorkloadFeatures(layers=tuple(layers), batch_size=bs, kind=kind)


def check_kind(kind: str) -> None:
    """Raise ValueError naming `kind` unless it is "training" or "inference"."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def check_batch_size(batch_size: object) -> int:
    """The batch size as an int; ValueError naming `batch_size` unless a positive integer."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return int(batch_size)


def check_example_batch(example_inputs: Any, batch_size: int) -> None:
    """ValueError unless some tensor of ``example_inputs`` has a dimension of ``batch_size``.

    Features are traced on the example batch and labelled with ``batch_size``: a batch of
    another size would be predicted as if it were this one. (Any dimension, not only the
    first: sequence-first models take their batch second.)"""
    shapes = [tuple(t.shape) for t in _tensors(example_inputs) if t.dim() >= 1]
    if shapes and not any(batch_size in shape for shape in shapes):
        raise ValueError(f"example_inputs hold no dimension of batch_size={batch_size} (shapes {shapes[:3]}): features "
                         f"are traced on that batch and labelled batch size {batch_size}; give one batch of "
                         f"{batch_size} inputs, or set batch_size to the examples' batch ({shapes[0][0]}?)")


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples/lists/dicts (PackedSequence is a tuple)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)


def _storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (meta tensors have no data pointer to compare)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return id(t)


def _nbytes(obj: Any, *, exclude: Any = ()) -> int:
    """Bytes of the distinct tensors in ``obj``, skipping any that share storage
    with a tensor in ``exclude`` (an in-place ReLU's or an Identity's output is
    its input: it adds no memory)."""
    skip = {_storage_key(t) for t in _tensors(exclude)}
    total = 0
    for t in _tensors(obj):
        key = _storage_key(t)
        if key not in skip:
            skip.add(key)
            total += t.numel() * t.element_size()
    return total


def _batch_size(example_inputs: Any) -> int:
    for t in _tensors(example_inputs):
        if t.dim() >= 1:
            return int(t.shape[0])
    raise ValueError(
        "cannot infer batch_size: example_inputs hold no tensor with a batch dimension; "
        "pass batch_size="
    )


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple, PackedSequence
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _on_device(model: nn.Module, inputs: Any, device: str | torch.device | None) -> tuple[nn.Module, Any]:
    """The model and inputs on ``device``; a deep copy unless already there."""
    if device is None:
        return model, inputs
    target = torch.device(device)
    state = list(model.parameters()) + list(model.buffers())
    if all(t.device == target for t in state):
        run_model = model
    else:
        try:
            run_model = copy.deepcopy(model).to(target)
        except Exception as exc:  # noqa: BLE001 - any copy failure means the same to the user
            raise ValueError(
                f"could not copy the model to device {str(target)!r} ({exc}); "
                "pass device=None to run it where it is"
            ) from exc
    return run_model, _map_tensors(inputs, lambda t: t.to(target))


def _as_call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return inputs, {}
    return (inputs,), {}


@contextlib.contextmanager
def _modes(model: nn.Module, training: bool) -> Iterator[None]:
    """Set train/eval for the trace and put every module's flag back afterwards."""
    saved = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextlib.contextmanager
def _no_mha_fastpath() -> Iterator[None]:
    """Make MultiheadAttention/Transformer layers run their decomposed path.

    The eval-mode fast path calls fused kernels (``_native_multi_head_attention``,
    ``_transformer_encoder_layer_fwd``) whose FLOPs the counter cannot see.
    """
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _cpu_sdpa_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of CPU flash attention, which FlopCounterMode has no formula for."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q, k, v)


def _flop_counter() -> FlopCounterMode:
    mapping: dict[Any, Any] = {}
    cpu_sdpa = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_sdpa is not None:
        mapping[cpu_sdpa] = _cpu_sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=mapping)


def _is_layer(module: nn.Module) -> bool:
    """A layer is a leaf, or a module of a known kind we do not look inside (LSTM, MHA)."""
    return next(iter(module.children()), None) is None or op_kind(module) != "other"


def _rnn_flops(module: nn.Module, args: tuple[Any, ...]) -> float:
    """Textbook FLOPs of an RNN module, for kernels FlopCounterMode cannot see.

    Per token, layer and direction: 2 * gates * hidden * (input + hidden)
    (4 gates for LSTM, 3 for GRU, 1 for a plain RNN).
    """
    if not args:
        return 0.0
    x = args[0]
    if isinstance(module, nn.RNNBase):
        data = x.data if isinstance(x, nn.utils.rnn.PackedSequence) else x
        tokens = data.shape[0] if data.dim() == 2 else data.shape[0] * data.shape[1]
        gates, hidden = _RNN_GATES.get(module.mode, 1), module.hidden_size
        out = module.proj_size or hidden
        dirs = 2 if module.bidirectional else 1
        total = 0.0
        for layer in range(module.num_layers):
            width = module.input_size if layer == 0 else out * dirs
            per_token = 2 * gates * hidden * (width + out) + 2 * hidden * module.proj_size
            total += dirs * tokens * per_token
        return float(total)
    if isinstance(module, nn.RNNCellBase):
        gates = next((g for t, g in _CELL_GATES.items() if isinstance(module, t)), 1)
        rows = x.shape[0] if x.dim() == 2 else 1
        return float(2 * gates * module.hidden_size * (module.input_size + module.hidden_size) * rows)
    return 0.0


@dataclass
class _Frame:
    """An open module call: the counter's total at entry and what children took."""

    start: int
    children: int = 0


@dataclass
class _Tracer:
    """Forward hooks that turn the counter's running total into per-call layers."""

    counter: FlopCounterMode
    root: nn.Module
    layers: list[LayerFeature] = field(default_factory=list)
    stack: list[_Frame] = field(default_factory=list)
    seen_params: set[int] = field(default_factory=set)

    def hook_all(self) -> list[torch.utils.hooks.RemovableHandle]:
        handles: list[torch.utils.hooks.RemovableHandle] = []
        hooked: set[int] = set()

        def visit(module: nn.Module, name: str) -> None:
            if id(module) in hooked:
                return
            hooked.add(id(module))
            is_layer = _is_layer(module)
            handles.append(module.register_forward_pre_hook(self._pre))
            handles.append(module.register_forward_hook(self._post(name, is_layer), with_kwargs=True))
            if not is_layer:
                for child_name, child in module.named_children():
                    visit(child, f"{name}.{child_name}" if name else child_name)

        visit(self.root, "")
        return handles

    def _pre(self, module: nn.Module, args: Any) -> None:
        self.stack.append(_Frame(start=self.counter.get_total_flops()))

    def _post(self, name: str, is_layer: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            frame = self.stack.pop()
            inclusive = self.counter.get_total_flops() - frame.start
            if self.stack:
                self.stack[-1].children += inclusive
            if is_layer:
                self._add_layer(module, name, inclusive, (args, kwargs), output)
            else:
                self._add_functional(module, name, inclusive - frame.children, (args, kwargs), output)

        return hook

    def _new_params(self, module: nn.Module, recurse: bool) -> int:
        """Parameters not yet attributed: shared modules and tied weights count once."""
        count = 0
        for p in module.parameters(recurse=recurse):
            if id(p) not in self.seen_params:
                self.seen_params.add(id(p))
                count += p.numel()
        return count

    def _add_layer(self, module: nn.Module, name: str, flops: int, inputs: Any, output: Any) -> None:
        op = op_kind(module)
        value = float(flops)
        if value == 0 and op == "rnn":  # fused CPU/cuDNN RNN kernels are opaque to the counter
            value = _rnn_flops(module, inputs[0])
        self.layers.append(LayerFeature(
            name=name or type(module).__name__, op=op, flops=value,
            params=self._new_params(module, recurse=True),
            activation_bytes=_nbytes(output, exclude=inputs), input_bytes=_nbytes(inputs),
        ))

    def _add_functional(self, module: nn.Module, name: str, flops: int, inputs: Any, output: Any) -> None:
        """FLOPs (or direct parameters) of a container's own forward code.

        Bytes are the container's input and output: a proxy for what its
        functional ops read and write.
        """
        params = self._new_params(module, recurse=False)
        if flops <= 0 and params == 0:
            return
        self.layers.append(LayerFeature(
            name=f"{name}.{FUNCTIONAL_SUFFIX}" if name else FUNCTIONAL_SUFFIX,
            op="matmul" if flops > 0 else "other", flops=float(max(flops, 0)), params=params,
            activation_bytes=_nbytes(output, exclude=inputs), input_bytes=_nbytes(inputs),
        ))


def _trace_layers(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, training: bool, on_meta: bool
) -> list[LayerFeature]:
    counter = _flop_counter()
    tracer = _Tracer(counter=counter, root=model)
    handles = tracer.hook_all()
    try:
        with _modes(model, training), _no_mha_fastpath(), torch.no_grad(), counter:
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with context, original chained
        raise ValueError(
            f"the forward pass of {type(model).__name__} on the example input failed: "
            f"{type(exc).__name__}: {exc}"
            + (" (it ran on the meta device; pass device=None if forward needs real values)"
               if on_meta else "")
        ) from exc
    finally:
        for handle in handles:
            handle.remove()
    return tracer.layers


__all__ = [
    "OP_KINDS", "KINDS", "LayerFeature", "WorkloadFeatures", "check_batch_size", "check_example_batch", "check_kind",
    "extract_features", "op_kind",
]
