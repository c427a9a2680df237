"""A zoo of real architectures from transformers, built from tiny configs with random weights.

Every case builds `(model, example_inputs, loss_fn, optimizer)` deterministically (seeded) and
without any download: models come from config objects. Sizes are tiny (hidden 64 or less, 1-2
layers, vocabulary 256, sequence 16, batch 2, 32x32 images) so that an eager compile and three
steps take a few seconds. Models keep their configs' defaults where it matters to glmc (tied
embeddings, dropout, the default attention implementation), since that is what users run.

timm is not in the zoo: its only torchvision that accepts torch 2.13 on PyPI is a CUDA build
whose `_C` extension needs `libtorch_cuda.so`, so `import timm` fails on the CPU torch this
project pins. The vision cases use transformers' ViT, ResNet, MobileNetV2 and ConvNeXt.

`run(case, mode)` trains one case for three steps through glmc and through plain PyTorch;
`check(run)` asserts what "works" means for that mode. Used by tests/test_zoo.py and by
benchmarks/zoo_table.py, which calls a failed check "partial" and any other error "no".
"""
from __future__ import annotations

import copy
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tests.models import ATOL, RTOL, assert_state_close, eager_losses, glmc_losses, twin

BATCH, SEQ, VOCAB, IMAGE, LABELS = 2, 16, 256, 32, 10

Workload = tuple[torch.nn.Module, dict[str, torch.Tensor], Any, torch.optim.Optimizer]


@dataclass(frozen=True)
class ZooCase:
    """One architecture. `source` names the class it instantiates ("transformers.X");
    `dropout` says whether its forward draws random masks."""
    name: str
    source: str
    make: Callable[[], Workload]
    dropout: bool = False
    #: why a rewritten step (fusion, Inductor) can only be compared at step 0: a model whose
    #: training amplifies rounding (in plain PyTorch 1e-7 relative noise on the weights moves
    #: its loss by 1e-2 or more after one step), so no two correct implementations agree after it
    ill_conditioned: str = ""
    tags: frozenset[str] = field(default_factory=frozenset)


def _tokens(n: int = SEQ, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, n), generator=torch.Generator().manual_seed(seed))


def _hf(model_cls: str, config_cls: str, config: dict[str, Any],
        inputs: Callable[[], dict[str, torch.Tensor]], lr: float = 1e-3) -> Callable[[], Workload]:
    """A builder: transformers' `model_cls(config_cls(**config))`, seeded; the model computes
    its own loss."""
    def make() -> Workload:
        tf = importlib.import_module("transformers")
        torch.manual_seed(0)
        model = getattr(tf, model_cls)(getattr(tf, config_cls)(**config))
        model.train()
        return model, inputs(), None, torch.optim.AdamW(model.parameters(), lr=lr)
    return make


def _lm_inputs() -> dict[str, torch.Tensor]:
    ids = _tokens()
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq_inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": _tokens(), "labels": _tokens(seed=2)}


def _cls_inputs() -> dict[str, torch.Tensor]:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0  # one padded row: the attention mask is really used
    labels = torch.tensor([0, 2])
    return {"input_ids": _tokens(), "attention_mask": mask, "labels": labels}


def _image_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, LABELS, (BATCH,), generator=g)}


def _whisper_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # the encoder's two convolutions halve 2 * max_source_positions frames to max_source_positions
    return {"input_features": torch.randn(BATCH, 16, 32, generator=g), "labels": _tokens(8, seed=2)}


DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

_CASES = [
    ZooCase("gpt2", "transformers.GPT2LMHeadModel", _hf(
        "GPT2LMHeadModel", "GPT2Config",
        dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
             eos_token_id=0),
        _lm_inputs), dropout=True, tags=frozenset({"tied"})),
    ZooCase("t5", "transformers.T5ForConditionalGeneration", _hf(
        "T5ForConditionalGeneration", "T5Config",
        dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
             decoder_start_token_id=0, pad_token_id=0),
        _seq2seq_inputs), dropout=True, tags=frozenset({"tied"})),
    ZooCase("bert_cls", "transformers.BertForSequenceClassification", _hf(
        "BertForSequenceClassification", "BertConfig",
        dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=64, num_labels=3,
             hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
        _cls_inputs), dropout=True),
    ZooCase("llama", "transformers.LlamaForCausalLM", _hf(
        "LlamaForCausalLM", "LlamaConfig", DECODER, _lm_inputs)),
    ZooCase("qwen2_tied", "transformers.Qwen2ForCausalLM", _hf(
        "Qwen2ForCausalLM", "Qwen2Config",
        # eager attention (bmm, softmax, bmm): the one case where fusion's attention pattern
        # has work to do; every other case uses transformers' default, SDPA
        dict(DECODER, tie_word_embeddings=True, attn_implementation="eager"), _lm_inputs),
        tags=frozenset({"tied"})),
    ZooCase("mixtral", "transformers.MixtralForCausalLM", _hf(
        "MixtralForCausalLM", "MixtralConfig",
        dict(DECODER, num_local_experts=4, num_experts_per_tok=2), _lm_inputs),
        tags=frozenset({"moe"})),
    ZooCase("qwen2_moe", "transformers.Qwen2MoeForCausalLM", _hf(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        dict(DECODER, moe_intermediate_size=32, shared_expert_intermediate_size=64,
             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
        _lm_inputs), tags=frozenset({"moe"})),
    ZooCase("gemma", "transformers.GemmaForCausalLM", _hf(
        "GemmaForCausalLM", "GemmaConfig", dict(DECODER, head_dim=16), _lm_inputs),
        tags=frozenset({"tied"})),
    ZooCase("phi", "transformers.PhiForCausalLM", _hf(
        "PhiForCausalLM", "PhiConfig", dict(DECODER, resid_pdrop=0.1), _lm_inputs), dropout=True),
    ZooCase("whisper", "transformers.WhisperForConditionalGeneration", _hf(
        "WhisperForConditionalGeneration", "WhisperConfig",
        dict(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=1, decoder_layers=1,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
             decoder_ffn_dim=128, max_source_positions=16, max_target_positions=32,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
             suppress_tokens=None, begin_suppress_tokens=None),
        _whisper_inputs), tags=frozenset({"tied"})),
    ZooCase("distilbert_cls", "transformers.DistilBertForSequenceClassification", _hf(
        "DistilBertForSequenceClassification", "DistilBertConfig",
        dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
             max_position_embeddings=64, num_labels=3),
        _cls_inputs), dropout=True),
    ZooCase("vit", "transformers.ViTForImageClassification", _hf(
        "ViTForImageClassification", "ViTConfig",
        dict(image_size=IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=128, num_labels=LABELS),
        _image_inputs), tags=frozenset({"vision"})),
    ZooCase("resnet", "transformers.ResNetForImageClassification", _hf(
        "ResNetForImageClassification", "ResNetConfig",
        dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
             num_labels=LABELS),
        _image_inputs), tags=frozenset({"vision"})),
    ZooCase("mobilenet_v2", "transformers.MobileNetV2ForImageClassification", _hf(
        "MobileNetV2ForImageClassification", "MobileNetV2Config",
        dict(image_size=IMAGE, depth_multiplier=0.25, finegrained_output=False,
             num_labels=LABELS),
        _image_inputs), dropout=True, tags=frozenset({"vision"}),
        ill_conditioned="17 BatchNorm'd blocks on 2 images: in plain PyTorch a 1e-7 relative "
                        "change of the weights moves the loss by 4e-2 after one step"),
    ZooCase("convnext", "transformers.ConvNextForImageClassification", _hf(
        "ConvNextForImageClassification", "ConvNextConfig",
        dict(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=IMAGE,
             num_labels=LABELS),
        _image_inputs), tags=frozenset({"vision"})),
]

ZOO: dict[str, ZooCase] = {case.name: case for case in _CASES}


def param_count(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights once), as `model.parameters()` yields them."""
    return sum(p.numel() for p in model.parameters())


# ---- one case in one mode -------------------------------------------------------------------

STEPS = 3
#: bf16 at step 0: within this relative distance of the fp32 loss
BF16_RTOL = 0.05


@dataclass(frozen=True)
class Mode:
    """glmc.optimize options, and whether both sides train with SGD instead of the case's AdamW.

    A rewritten step (fused ops, Inductor's kernels) rounds differently from eager PyTorch, and
    Adam turns that noise into lr-sized steps wherever a gradient is near zero (the key bias,
    whose exact gradient is zero, and single elements of any weight: 1.8e-5 on one element of
    Phi's fc2 after 3 steps). SGD's update is linear in the gradient, so under SGD the
    comparison measures the rewrite's rounding (1e-8 here), which the parity tolerances bound.
    The zoo checks numerics, not the cost model: no prediction and no profiled step."""
    options: dict[str, Any]
    sgd: bool = False


MODES: dict[str, Mode] = {
    "eager": Mode(dict(backend="eager", fusion=False)),  # capture + backend: bit-identical
    "fusion": Mode(dict(backend="eager"), sgd=True),  # the default pipeline: fusion, cleanup
    "bf16": Mode(dict(backend="eager", fusion=False, precision="bf16")),
    "inductor": Mode(dict(backend="inductor"), sgd=True),  # the default pipeline on Inductor
}


@dataclass
class Run:
    """Losses of glmc and of eager PyTorch (fp32) over STEPS steps, and both sides' state."""
    case: ZooCase
    mode: str
    losses: list[float]
    reference: list[float]
    trainer: Any
    glmc_side: Workload
    eager_side: Workload

    @property
    def max_loss_diff(self) -> float:
        return max(abs(a - b) for a, b in zip(self.losses, self.reference))

    def counts(self, pass_name: str) -> dict[str, Any]:
        """The typed stats of `pass_name` in the last compile as a dict ({} if it did not run):
        fusion's regions per pattern, precision's casts, ..."""
        for record in self.trainer.report.compiles[-1].history:
            if record.name == pass_name and record.stats is not None:
                stats = record.stats
                return dict(stats.counts) if hasattr(stats, "counts") else vars(stats)
        return {}


def _sgd(make: Callable[[], Workload]) -> Callable[[], Workload]:
    def make_sgd() -> Workload:
        model, x, loss_fn, _ = make()
        return model, x, loss_fn, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return make_sgd


def run(case: ZooCase, mode: str, steps: int = STEPS) -> Run:
    """Twin copies of the case: one trained by glmc in `mode`, one by plain PyTorch, each step
    under the same seed (dropout draws the same masks)."""
    import glmc

    spec = MODES[mode]
    (m, x, lf, opt), (m2, _, _, opt2) = twin(_sgd(case.make) if spec.sgd else case.make)
    trainer = glmc.optimize(m, x, loss_fn=lf, optimizer=opt, measure=False, predict=False,
                            **spec.options)
    got = glmc_losses(trainer, x, steps)
    want = eager_losses(m2, x, lf, opt2, steps)
    return Run(case, mode, got, want, trainer, (m, x, lf, opt), (m2, x, lf, opt2))


def check(r: Run) -> None:
    """What "works" means: one whole-step graph; then for fp32 modes losses at rtol 1e-4 and
    parameters and optimizer state within tests.models' tolerances (the same parameters hold
    state on both sides), for an ill-conditioned case under a rewrite the step-0 loss; for bf16
    some ops in bf16 and finite losses that fall, the first within BF16_RTOL of fp32."""
    compiles = r.trainer.report.compiles
    assert all(c.nodes_captured for c in compiles), (
        "compiled in pieces (graph breaks): "
        + "; ".join(f"{f.reason} at {f.location}" for c in compiles for f in c.fallbacks))
    if r.mode == "bf16":
        low = r.counts("precision").get("forward_dtypes", {}).get("bf16", 0)
        assert low, "the precision pass left no forward op in bf16"
        assert all(math.isfinite(v) for v in r.losses), f"non-finite bf16 loss: {r.losses}"
        rel = abs(r.losses[0] - r.reference[0]) / abs(r.reference[0])
        assert rel <= BF16_RTOL, f"bf16 loss {r.losses[0]:.4f} vs fp32 {r.reference[0]:.4f}"
        assert r.losses[-1] < r.losses[0], f"bf16 loss does not fall: {r.losses}"
        return
    if r.case.ill_conditioned and MODES[r.mode].sgd:
        assert all(math.isfinite(v) for v in r.losses), f"non-finite loss: {r.losses}"
        torch.testing.assert_close(r.losses[0], r.reference[0], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"step-0 loss: {m}")
        return
    torch.testing.assert_close(torch.tensor(r.losses), torch.tensor(r.reference),
                               rtol=RTOL, atol=ATOL, msg=lambda m: f"losses: {m}")
    assert r.losses[0] != r.losses[-1], "training must change the loss"
    (m, _, _, opt), (m2, _, _, opt2) = r.glmc_side, r.eager_side
    stray = _state_mismatch(m, opt, opt2)
    assert not stray, f"optimizer state on one side only: {'; '.join(stray)}"
    assert_state_close(m, m2, opt, opt2)


def _state_mismatch(model: torch.nn.Module, opt_a: torch.optim.Optimizer,
                    opt_b: torch.optim.Optimizer) -> list[str]:
    """Parameters that hold optimizer state on one side only (torch.optim creates it at the
    first step in which the parameter has a gradient)."""
    names = [n for n, _ in model.named_parameters()]
    a, b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    return [f"{names[k]} (glmc: {sorted(a.get(k, {}))}, torch: {sorted(b.get(k, {}))})"
            for k in sorted(set(a) | set(b)) if set(a.get(k, {})) != set(b.get(k, {}))]


# ---- data parallel: one case on 2 processes -----------------------------------------------------

#: column -> parallel= option: each ZeRO stage, and each compression method on a stage it fits
PARALLEL: dict[str, dict[str, Any]] = {
    "zero 0": {"zero": 0}, "zero 1": {"zero": 1}, "zero 2": {"zero": 2},
    "zero 3": {"zero": 3},
    "bf16, zero 2": {"zero": 2, "compress": {"method": "bf16"}},
    "sign": {"zero": 0, "compress": {"method": "sign"}},
    "sign/64, zero 1": {"zero": 1, "compress": {"method": "sign", "block": 64}},
    "topk 1%, zero 1": {"zero": 1, "compress": {"method": "topk", "ratio": 0.01}},
    "powersgd r4": {"zero": 0, "compress": {"method": "powersgd", "rank": 4}},
}
#: ZeRO stages against one process; bf16 transfer against stage 0
PARALLEL_RTOL, STAGE_RTOL, BF16_WIRE_RTOL = 1e-4, 1e-5, 1e-3


def parallel_losses(case: ZooCase, parallel: dict[str, Any] | None, frozen: bool = False
                    ) -> tuple[list[float], float | None]:
    """STEPS steps of the case through glmc on this process group (each rank half the batch;
    eager backend), or of plain PyTorch in this process on the whole batch (parallel=None);
    with the compress pass's wire ratio where it ran. `frozen`: learning rate 0, the losses
    the same steps see without training (dropout draws the same masks)."""
    import glmc
    model, batch, loss_fn, opt = case.make()
    if frozen:
        for group in opt.param_groups:
            group["lr"] = 0.0
    if parallel is None:
        return eager_losses(model, batch, loss_fn, opt, STEPS), None
    trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            predict=False, measure=False, parallel=copy.deepcopy(parallel))
    stats = next((r.stats for r in trainer.report.compiles[-1].history
                  if r.name == "compress"), None)
    return glmc_losses(trainer, batch, STEPS), (stats.ratio if stats is not None else None)


def parallel_cells(case: ZooCase) -> dict[str, tuple | str]:
    """Every PARALLEL column of the case on this process group (an exception: its text), with
    "one process" (plain PyTorch, whole batch) and "frozen" (stage 0 at learning rate 0)."""
    import torch.distributed as dist
    cells: dict[str, tuple | str] = {"one process": parallel_losses(case, None)}
    runs = {"frozen": ({"zero": 0}, True), **{c: (p, False) for c, p in PARALLEL.items()}}
    for column, (parallel, frozen) in runs.items():
        try:
            cells[column] = parallel_losses(case, parallel, frozen)
        except Exception as e:  # noqa: BLE001 -- every failure is a cell
            first = (str(e).strip().splitlines() or [""])[0]
            cells[column] = f"{type(e).__name__}: {first[:160]}"
        dist.barrier()
    return cells


def comparable_to_one_process(case: ZooCase) -> bool:
    """Whether a data-parallel step can equal one process's on the whole batch: not where
    dropout masks are drawn per rank, nor where BatchNorm normalises each rank's half."""
    model = case.make()[0]
    return not case.dropout and not any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def judge_parallel(column: str, cells: dict[str, tuple | str], exact: bool
                   ) -> tuple[str, str]:
    """(works|partial|no, why) of one case in one PARALLEL column, from `parallel_cells`.
    ZeRO stages: the losses of one process at PARALLEL_RTOL where `exact`, else stage 0's at
    STAGE_RTOL (stage 0 itself: it trains); bf16 transfer: stage 0's at BF16_WIRE_RTOL; lossy
    methods: it trains. "It trains": the last loss below the frozen run's (the same steps,
    the same dropout masks, no update)."""
    got = cells[column]
    if isinstance(got, str):
        return "no", got
    losses, ratio = got
    frozen = cells["frozen"]
    trains = not isinstance(frozen, str) and losses[-1] < frozen[0][-1]

    def close(ref: tuple | str, rtol: float) -> bool:
        return not isinstance(ref, str) and all(abs(a - b) <= rtol * abs(b)
                                                for a, b in zip(losses, ref[0]))
    if column.startswith("zero"):
        if exact:
            return ("works", "= one process") if close(cells["one process"], PARALLEL_RTOL) \
                else ("partial", "differs from one process")
        if column == "zero 0":
            return ("works", "trains") if trains else ("partial", "does not train")
        return ("works", "= zero 0") if close(cells["zero 0"], STAGE_RTOL) and trains else \
            ("partial", "differs from zero 0")
    if column.startswith("bf16"):
        return ("works", "= zero 0 at 1e-3") if close(cells["zero 0"], BF16_WIRE_RTOL) else \
            ("partial", "differs from zero 0")
    return ("works", f"{ratio}:1") if trains else ("partial", f"{ratio}:1, does not train")
