"""The analytic memory prior: bytes of a training step from the model's dimensions, before any measurement.

Peak device memory of one training step (the seeds' M ~ P.D_param + B.A.D_act + O.D_opt)::

    peak(b) = held(precision, optim, sharding, b) + b * activations_per_sample(precision, attn, checkpointing, compile, liger)

* ``static``: fp32 master weights (4 B/param, also under AMP, where autocast adds a 16-bit copy of
  the weights it casts, 2 B/param), fp32 gradients (4 B/param), optimizer state (AdamW 8 B/param,
  8-bit Adam 2, Adafactor factored: about (rows + cols) floats per matrix), plus the CUDA context;
  partitioned over the ranks or moved to the host by a ZeRO stage (:mod:`autotune.sharding`).
  AdamW in fp32 gives the 16 B/param that ``accelerate estimate-memory`` reports as "Training using Adam".
* ``held``: the static memory the peak holds. The gradients are not part of it unless they outlive
  the forward pass (accumulation, a ZeRO stage) or outweigh the activations (:func:`peak_static_bytes`).
* ``activations_per_sample``: per layer ``s.h.(34 + 5.a.s/h)`` bytes in 16-bit (Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2; the MLP part
  scaled by ``intermediate_size / 4h``); doubled in fp32; the ``5.a.s/h`` attention-score term only
  for ``eager`` attention (SDPA/FlashAttention never materialise the s x s scores); with
  checkpointing only each layer's input is kept (``2.s.h`` bytes) plus one layer recomputed;
  plus the logits (``s.V`` in the compute dtype, upcast to fp32 for the loss, and their gradient),
  which Liger's fused linear cross-entropy (``use_liger_kernel``) never materialises: it computes
  the loss and the hidden state's gradient chunk by chunk, keeping only that gradient (``s.h``).
  A ``+tf32`` precision stores as its 16-bit base (TF32 changes how matmuls compute, not what is kept).

Without a model config (a replay table) only relative factors are known (:func:`generic_features`).
:class:`autotune.search.memory.MemoryModel` calibrates either from measured peaks. Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.params import TrialParams, mixed_precision_dtype
from autotune.sharding import NONE as NO_SHARDING
from autotune.sharding import device_shares, host_shares

# Bytes per parameter of optimizer state, by substring of the TrainingArguments optim name (first match),
# for float32 parameters, and whether the state is kept in the parameters' dtype (torch's optimizers
# allocate it like the parameter, so it halves for bf16 ones) or in its own (bitsandbytes' 8-bit and
# 32-bit states, torchao's low-bit ones). Adafactor is handled apart (factored second moment, no first
# moment by default, float32).
# Paged optimizers (paged_adamw_8bit, paged_adamw_32bit, paged_lion_*, paged_ademamix_*: bitsandbytes)
# keep their state in CUDA unified memory, which the driver pages out to host memory only under
# memory pressure: they are modelled as their 8-bit or 32-bit state on the device, the peak when
# nothing is paged out (a probe that pages shows it in its measured peak and speed).
_OPTIM_STATE_BYTES: tuple[tuple[str, float, bool], ...] = (
    ("4bit", 1.0, False),
    ("lion_8bit", 1.0, False),  # one 1-byte moment
    ("rmsprop_bnb_8bit", 1.0, False),  # one 1-byte moment
    ("ademamix_8bit", 3.0, False),  # three 1-byte states
    ("8bit", 2.0, False),  # two 1-byte moments (+ block-wise scales, negligible): adamw_8bit, adamw_bnb_8bit, adamw_torch_8bit
    ("lion", 4.0, False),  # one float32 moment: transformers takes every Lion from bitsandbytes
    ("sgd", 0.0, True),  # TrainingArguments' sgd has no momentum by default
    ("adagrad", 4.0, True),
    ("rmsprop_bnb", 4.0, False),  # bitsandbytes' 32-bit RMSprop
    ("rmsprop", 4.0, True),
    ("ademamix", 12.0, False),  # two EMAs of the gradient + second moment, float32 (bitsandbytes)
    ("paged_adamw_32bit", 8.0, False),  # bitsandbytes' float32 moments
    ("adam", 8.0, True),  # adamw_torch, adamw_torch_fused, adamw_hf, adamw_apex_fused...
)
_DEFAULT_OPTIM_STATE_BYTES = 8.0
# Device memory a training process uses outside the caching allocator, as NVML sees it. The context
# alone is ~400-500 MB with lazy module loading (pytorch#109888); on Hopper with CUDA 12/13 the
# cuBLAS/cuBLASLt/cuDNN handles, their lazily loaded kernels and the workspaces cuBLAS takes with
# cudaMallocAsync outside PyTorch's allocator (CUDA >= 12.2, pytorch#124250) add about 1 GB more.
# A probe measures its own (ProbeResult.non_allocator_bytes); this is the prior before any probe.
CUDA_CONTEXT_BYTES = 1536 * 2**20
COMPILE_ACTIVATION_FACTOR = 0.85  # inductor fuses pointwise ops, so fewer intermediates are saved
# Without model dims (a replay): the share of activations Liger's fused cross-entropy removes, the logits
# being some tenths of them at common vocabularies and widths; the calibration fits the rest.
LIGER_ACTIVATION_FACTOR = 0.7
# QLoRA's NF4 weights: 4 bits each, plus block-wise absmax constants (double-quantized: ~0.127 bits
# per weight, Dettmers et al. 2023, "QLoRA", sec. 3).
QLORA_BYTES_PER_QUANTIZED_PARAM = 0.5 + 0.127 / 8


@dataclass(frozen=True)
class ModelDims:
    """The model dimensions the memory model needs (from a :class:`~autotune.models.ModelSpec`)."""

    num_parameters: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int
    # LoRA (autotune.lora): parameters that are trained (None: all of them), and frozen ones stored in
    # 4 bits (QLoRA's base linear layers). num_parameters counts every parameter, adapters included.
    trainable_parameters: int | None = None
    quantized_parameters: int = 0
    # Storage of the user's model as built (ParameterCounts' dtypes), None when not counted: float32.
    # parameter_bytes: the parameters that are not quantized; trainable_bytes: the trainable ones (and
    # so their gradients); fp32_parameters: those autocast copies into 16 bits.
    parameter_bytes: int | None = None
    trainable_bytes: int | None = None
    fp32_parameters: int | None = None

    @classmethod
    def from_spec(cls, spec: Any, num_parameters: int | None = None, *, counts: Any = None) -> ModelDims:
        """Read the dimensions of a ``ModelSpec``; parameters counted on the meta device unless given.

        ``counts``: an :class:`autotune.lora.ParameterCounts` of the model as trained (LoRA adapters
        on a frozen base); its total replaces ``num_parameters``.
        """
        if counts is not None:
            num_parameters = counts.total
        if num_parameters is None:
            from autotune.models import count_parameters

            num_parameters = count_parameters(spec)
        config = spec.config
        intermediate = config.get("intermediate_size") or config.get("n_inner") or 4 * spec.hidden_size
        return cls(num_parameters, spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.vocab_size, int(intermediate),
                   trainable_parameters=counts.trainable if counts is not None else None,
                   quantized_parameters=counts.quantized if counts is not None else 0,
                   parameter_bytes=counts.stored_bytes() if counts is not None else None,
                   trainable_bytes=counts.trainable_bytes() if counts is not None else None,
                   fp32_parameters=counts.fp32_parameters() if counts is not None else None)

    @property
    def trainable(self) -> int:
        """Parameters with a gradient and optimizer state (all of them unless LoRA froze the base)."""
        return self.num_parameters if self.trainable_parameters is None else self.trainable_parameters


@dataclass(frozen=True)
class StaticMemory:
    """Memory that does not depend on batch size, in bytes."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.overhead_bytes


def optimizer_state_bytes(optim: str, num_parameters: int, hidden_size: int, parameter_bytes: float | None = None) -> int:
    """Bytes of optimizer state for ``num_parameters`` parameters taking ``parameter_bytes`` in all
    (None: float32), which sizes the state of optimizers that keep it in the parameters' dtype."""
    if "adafactor" in optim:
        # Factored second moment: one row and one column vector per matrix, ~ (rows + cols) floats
        # for rows x cols entries; with matrices about hidden_size wide that is ~ 2/hidden_size
        # floats per parameter (Shazeer & Stern 2018, sec. 3).
        return int(4 * num_parameters * 2 / max(hidden_size, 1))
    per_param, like_parameter = next(((b, like) for marker, b, like in _OPTIM_STATE_BYTES if marker in optim),
                                     (_DEFAULT_OPTIM_STATE_BYTES, True))
    state = per_param * num_parameters
    if like_parameter and parameter_bytes is not None and num_parameters:
        state *= parameter_bytes / (4 * num_parameters)
    return int(state)


def optimizer_state_rank(optim: str) -> int:
    """A key that orders optimizers by the memory their state takes (their state for a typical model: 1 B
    parameters, 2048 wide): the frugal end of a search, which needs no less memory, the expert's lighter step."""
    return optimizer_state_bytes(optim, 10**9, 2048)


def static_memory(dims: ModelDims, precision: str, optim: str, sharding: str = NO_SHARDING, world: int = 1) -> StaticMemory:
    """Weights, gradients, optimizer state and CUDA context on one device for one precision and optimizer, less what
    ``sharding`` partitions over ``world`` ranks or moves to the host (:func:`autotune.sharding.device_shares`;
    :func:`host_state_bytes` is what the host holds).

    Frozen parameters (a LoRA base) carry no gradient and no optimizer state; only the trainable
    ones (the adapters) do. Parameters are float32 unless ``dims`` says how the user's model stores
    them (a base loaded in bf16 takes 2 B per weight and needs no autocast copy). QLoRA's quantized
    base weights take ~0.52 B/param and no autocast copy (bitsandbytes dequantizes them layer by
    layer into the compute dtype).
    """
    weights, gradients, optimizer = _state_bytes(dims, precision, optim, sharding)
    if sharding != NO_SHARDING:
        keep_weights, keep_gradients, keep_optimizer = device_shares(sharding, world)
        weights, gradients, optimizer = int(weights * keep_weights), int(gradients * keep_gradients), int(optimizer * keep_optimizer)
    return StaticMemory(weights_bytes=weights, gradients_bytes=gradients, optimizer_bytes=optimizer, overhead_bytes=CUDA_CONTEXT_BYTES)


def _state_bytes(dims: ModelDims, precision: str, optim: str, sharding: str) -> tuple[int, int, int]:
    """The whole model's weights, gradients and optimizer state, unpartitioned, as the training holds them."""
    q = dims.quantized_parameters
    p = dims.num_parameters - q
    trainable = dims.trainable
    stored = 4 * p if dims.parameter_bytes is None else dims.parameter_bytes  # float32 unless counted
    fp32 = p if dims.fp32_parameters is None else dims.fp32_parameters
    amp = mixed_precision_dtype(precision) is not None
    weights = stored + (2 * fp32 if amp else 0)  # + autocast's 16-bit copies of fp32 weights
    weights += int(q * QLORA_BYTES_PER_QUANTIZED_PARAM)
    # Gradients have the parameters' dtype (fp32 under AMP too), and so does the state of torch's optimizers.
    gradients = 4 * trainable if dims.trainable_bytes is None else dims.trainable_bytes
    if sharding == NO_SHARDING:
        return weights, gradients, optimizer_state_bytes(optim, trainable, dims.hidden_size, dims.trainable_bytes)
    # DeepSpeed's ZeRO steps an fp32 master copy of the trainable weights with fp32 optimizer state, whatever the module
    # stores (a clone also when the module is fp32: stage_1_and_2's single_partition_of_fp32_groups); under mixed
    # precision it holds the module and its gradients in 16 bits: 2 + 2 + K bytes per parameter (Rajbhandari et al.
    # 2020, "ZeRO", sec. 3.1).
    optimizer = optimizer_state_bytes(optim, trainable, dims.hidden_size) + 4 * trainable
    if amp:
        weights -= 4 * fp32
        gradients = 2 * trainable
    return weights, gradients, optimizer


def host_state_bytes(dims: ModelDims, params: TrialParams) -> int:
    """Host memory the training state takes under ``params.sharding`` (all ranks together): the offloaded optimizer
    state with its fp32 master weights and the fp32 gradients it steps on, and offloaded parameters; 0 without offload
    (the processes' own host memory, a few GiB each, is not modelled). Mixed-precision AdamW: 16 bytes per parameter
    offloading the optimizer, 18 with the parameters too, DeepSpeed's own figures (``estimate_zero2_model_states_mem_needs``,
    ``estimate_zero3_...``, without their 1.5 safety factor)."""
    if params.sharding == NO_SHARDING:
        return 0
    weights, _, optimizer = _state_bytes(dims, params.precision, params.optim, params.sharding)
    keep_weights, keep_optimizer = host_shares(params.sharding)
    fp32_gradients = 4 * dims.trainable  # what the CPU Adam steps on, fp32 whatever the module stores
    return int(weights * keep_weights + (optimizer + fp32_gradients) * keep_optimizer)


def activation_bytes_per_sample(dims: ModelDims, params: TrialParams, seq_len: int) -> int:
    """Activation memory of one sample of ``seq_len`` tokens held for the backward pass."""
    s, h, a, layers = seq_len, dims.hidden_size, dims.num_attention_heads, dims.num_layers
    width = 2 if mixed_precision_dtype(params.precision) else 4  # bytes of an activation element
    scale = width / 2  # Korthikanti's coefficients count 16-bit activations
    mlp_scale = dims.intermediate_size / (4 * h)
    per_layer = s * h * (15 + 19 * mlp_scale) * scale  # 34.s.h at the standard 4h MLP
    if params.attn_implementation == "eager":
        per_layer += 5 * a * s * s * scale
    if params.gradient_checkpointing:
        # Only layer inputs are kept; one layer's activations are recomputed at a time in backward.
        layer_total = layers * s * h * width + per_layer
    else:
        layer_total = layers * per_layer
    if params.torch_compile != "off":
        layer_total *= COMPILE_ACTIVATION_FACTOR
    if params.use_liger_kernel:
        # Fused linear cross-entropy: no logits; the hidden state's gradient, computed in the forward pass, is kept.
        logits = s * h * width
    else:
        logits = s * dims.vocab_size * (width + 4 + 4)  # compute-dtype logits, fp32 upcast, fp32 gradient
    return int(layer_total + logits)


def peak_static_bytes(static: StaticMemory, params: TrialParams, activation_bytes: float) -> float:
    """The part of the peak that is not activations, beside ``activation_bytes`` of them.

    Without accumulation or a ZeRO stage the step holds no gradient at its activation peak, the end
    of the forward pass: the Trainer frees the last step's gradients after the optimizer step
    (``zero_grad(set_to_none=True)``), and this step's appear layer by layer as the backward pass
    frees the activations, so the step peaks at ``max(gradients, activations)`` beside the weights and
    optimizer state. Accumulating keeps the gradients across micro-batches, and DeepSpeed keeps its
    gradient partitions for the whole run: there the gradients are always held. Measured on an H100
    (polyglot-ko-1.3b fp32 at batch 8, 28 and 32: the peaks' intercept is the weights and AdamW state
    alone; pythia-160m's 161 probes that ran: the measured peak 0.78-0.91 of the analytic one with
    the gradients held, 0.88-1.05 without, medians by precision x compile x checkpointing x attention)."""
    if params.gradient_accumulation_steps > 1 or params.sharding != NO_SHARDING:
        return float(static.total_bytes)
    return float(static.total_bytes - static.gradients_bytes) + max(0.0, static.gradients_bytes - activation_bytes)


def predict_peak_bytes(dims: ModelDims, params: TrialParams, seq_len: int, world: int = 1) -> int:
    """Analytic peak memory of ``params`` on one device of ``world`` (no calibration)."""
    static = static_memory(dims, params.precision, params.optim, params.sharding, world)
    activations = params.per_device_train_batch_size * activation_bytes_per_sample(dims, params, seq_len)
    return int(peak_static_bytes(static, params, activations) + activations)


# ------------------------------------------------------------------------------ generic factors


def generic_features(params: TrialParams, world: int = 1) -> tuple[float, float]:
    """Relative static bytes per parameter and activation units per sample, without model dims.

    Used when no model config is known (a replay table): the two scales are then fitted from
    the measurements, and these factors only say how the groups differ from one another.
    """
    amp = mixed_precision_dtype(params.precision) is not None
    shares = device_shares(params.sharding, world)
    parts = (4 + (2 if amp else 0), 4, optimizer_state_bytes(params.optim, 1000, 1000) / 1000)  # weights, gradients, optimizer
    static = sum(part * share for part, share in zip(parts, shares))
    act = 1.0 if amp else 2.0
    if params.attn_implementation == "eager":
        act *= 1.5
    if params.gradient_checkpointing:
        act *= 0.15
    if params.torch_compile != "off":
        act *= COMPILE_ACTIVATION_FACTOR
    if params.use_liger_kernel:
        act *= LIGER_ACTIVATION_FACTOR
    return static, act
