"""CPU schedules for the legalized training step, without a tuner: DLight's approach (a rule
table applied to every TIR function after Relax legalization and fusion), for CPUs.

TVM's default CPU pipeline leaves every loop nest as legalization wrote it: one thread, no
tiling, no vectors. MetaSchedule, the tuner that would fix that, crashes in the TVM wheels
(docs/backends/tvm.md). DLight's own CPU rules cover GEMV and row reductions only. glmc adds:

* `Matmul`: any block that DLight's matmul analysis normalizes to C[S, I, J] += A[S, I, K] *
  B[S, J, K] (dense, batch matmul, every transposed layout the backward uses). A is read in
  place; B is packed once per call to [S, K, J] so the inner loop loads it contiguously. The
  output is tiled into register blocks of `rows` x `cols` (cols = 2 vectors of the target's
  SIMD width: 32 floats on AVX-512, 16 on AVX2, 8 on NEON), accumulated in a local buffer over
  K in chunks of `depth` (so a B panel stays in L2), the S x I tiles split across threads; the
  epilogue (bias, activation, residual add, reshape) runs on each tile while it is in cache.
  Shapes that do not divide the tiles are padded (`pad_einsum`), so every tile is vectorized.
* DLight's `cpu.Reduction` for softmax / layer norm / RMS norm (reduction then elementwise on
  the same rows), and `Reduction` below for every other reduction (bias gradients, loss sums):
  leading spatial loops in parallel, a contiguous trailing spatial loop vectorized under the
  reduction.
* `Elementwise`: injective chains inlined into one loop nest, the innermost loop vectorized to
  the SIMD width, the rest fused and split across threads when the work is large enough.

Each rule declines (returns None) a function it does not recognise; an unscheduled function
stays as legalization wrote it, correct but slow. The rules are shape-generic: nothing here
knows the model. Numerics: schedules reorder loops, not arithmetic, except that a tiled
reduction sums over K in a different order (fp32 accumulation either way; parity tests hold
the step to eager within the stated tolerance).
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: (rule, function, error) for every function a rule failed on in this process: the function
#: falls through to the next rule, or stays as legalization wrote it (correct, slow)
FAILURES: list[tuple[str, str, str]] = []

#: threads split a loop nest only above this many output elements (a parallel region costs
#: microseconds; small elementwise kernels run faster on one thread)
PARALLEL_MIN = 1 << 14


def _lanes(target: Any, bits: int = 32) -> int:
    """`bits`-wide elements per SIMD register of `target`, from its CPU features (LLVM's own
    `llvm_get_vector_width` answers for the host's x86 CPU, not the target's)."""
    from tvm.target.codegen import llvm_get_vector_width, target_has_features
    for feature, width in (("avx512f", 512), ("avx", 256), ("sve", 128), ("neon", 128),
                           ("sse2", 128)):
        if target_has_features(feature, target):
            return width // bits
    width = llvm_get_vector_width(target)
    return max((width if width > 0 else 128) // bits, 1)


def _extent(sch: Any, loop: Any) -> int | None:
    from tvm import tirx
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _product(sch: Any, loops: list[Any]) -> int | None:
    total = 1
    for loop in loops:
        extent = _extent(sch, loop)
        if extent is None:
            return None
        total *= extent
    return total


def _elements(sch: Any, block: Any) -> int:
    """Output elements one execution of `block`'s loop nest writes (unknown: large)."""
    loops = sch.get_loops(block)
    spatial = [lp for lp, iv in zip(loops, sch.get(block).iter_vars) if iv.iter_type == 0]
    return _product(sch, spatial) or PARALLEL_MIN


def _parallel_vectorize(sch: Any, block: Any, lanes: int) -> None:
    """The innermost loop split to `lanes` and vectorized where it divides, the loops above it
    fused and split across threads when the nest writes at least PARALLEL_MIN elements."""
    loops = sch.get_loops(block)
    if not loops:
        return
    last = _extent(sch, loops[-1])
    outer = list(loops[:-1])
    if last is not None and last % lanes == 0 and last >= lanes:
        head, vec = sch.split(loops[-1], factors=[None, lanes])
        sch.vectorize(vec)
        outer.append(head)
    elif last is not None and last < lanes and last > 1:
        sch.vectorize(loops[-1])
    else:
        outer.append(loops[-1])
    if outer and _elements(sch, block) >= PARALLEL_MIN:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


def _rule(apply: Any) -> Any:
    """A DLight ScheduleRule for LLVM (CPU) targets from `apply(func, target) -> Schedule`."""
    from tvm import tirx
    from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

    class Rule(CPUScheduleRule):
        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
                return None
            try:
                return apply(func, target)
            except Exception as e:  # TVM's schedule errors: this rule cannot schedule func
                last = (str(e).strip().splitlines() or [""])[-1]  # a bare assert: no message
                FAILURES.append((apply.__name__, str(func.attrs.get("global_symbol", "?")),
                                 f"{type(e).__name__}: {last[:200]}"))
                log.debug("tvm schedule rule %s declined a function", apply.__name__,
                          exc_info=True)
                return None  # the next rule (or none: the function stays unscheduled)

    Rule.__name__ = Rule.__qualname__ = apply.__name__.title().replace("_", "")
    return Rule()


# ---- the rules ---------------------------------------------------------------------------------

def matmul(func: Any, target: Any, rows: int | None = None, depth: int = 256,
           panel_bytes: int = 1 << 18) -> Any:
    """Register-blocked, packed, threaded GEMM for one matmul-like block (see module doc)."""
    from tvm import s_tir
    from tvm.s_tir.dlight.analysis.common_analysis import get_root_block
    from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers,
                                             get_index_map, get_reduction_blocks)
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = get_reduction_blocks(sch, blocks)
    if reductions is None or get_index_map(sch.get(reductions[0])) is None:
        return None
    main = reductions[0]
    lanes = _lanes(target)
    cols = 2 * lanes
    rows = rows or (4 if lanes * 32 == 256 else 8)  # AVX2 has 16 vector registers, others 32
    a = sch.reindex(main, ("read", 0))
    b = sch.reindex(main, ("read", 1))
    c = sch.reindex(main, ("write", 0))
    maps = get_index_map(sch.get(main))
    block_map, a_map, b_map, c_map = maps
    sch.transform_layout(a, ("write", 0), a_map)
    sch.transform_layout(b, ("write", 0), b_map)
    sch.transform_layout(c, ("read", 0), c_map)
    sch.transform_block_layout(main, block_map)
    sch.transform_layout(b, ("write", 0), lambda s, j, k: (s, k, j))  # pack B: J contiguous
    batch, i, j, k = sch.get_loops(main)
    extents = [_extent(sch, lp) for lp in (i, j, k)]
    if None in extents or extents[0] * extents[1] * extents[2] < 4 * rows * cols * lanes:
        return None  # symbolic or tiny: not worth a GEMM schedule
    k_tile = _k_tile(extents[2], depth)
    sch.pad_einsum(main, [1, rows, cols, k_tile])
    batch, i, j, k = sch.get_loops(main)
    panel = _panel(_extent(sch, j) // cols, _extent(sch, k), cols, panel_bytes) * cols
    jc, j = sch.split(j, factors=[None, panel])
    io, ii = sch.split(i, factors=[None, rows])
    jo, ji = sch.split(j, factors=[None, cols])
    ko, kt = sch.split(k, factors=[None, k_tile])
    kt, ku = sch.split(kt, factors=[None, 4])
    sch.reorder(batch, jc, io, jo, ko, kt, ku, ii, ji)
    sch.parallel(sch.fuse(batch, jc, io))
    sch.unroll(ku)
    sch.unroll(ii)
    sch.vectorize(ji)
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, jo, preserve_unit_loops=True)
    auto_inline_producers(sch, main)
    auto_inline_consumer_chain(sch, acc)
    sch.decompose_reduction(main, ko)
    _vectorize_tile(sch, acc, lanes)
    nest = [sch.get(loop) for loop in sch.get_loops(main)]
    for block in sch.get_child_blocks(get_root_block(sch)):
        loops = [sch.get(loop) for loop in sch.get_loops(block)]
        if not any(loop.same_as(other) for loop in loops for other in nest):
            _parallel_vectorize(sch, block, lanes)  # packing / padding / leftover epilogue
    return sch


def _panel(tiles: int, k_tile: int, cols: int, panel_bytes: int) -> int:
    """How many `cols`-wide tiles of packed B one thread sweeps before moving to the next rows
    of A: the most (dividing `tiles`, so no tail) whose k_tile x width floats fit
    `panel_bytes` (half a typical L2), at least one."""
    most = max(panel_bytes // (4 * k_tile * cols), 1)
    return max(t for t in range(1, min(most, tiles) + 1) if tiles % t == 0)


def _k_tile(k: int, depth: int) -> int:
    """The K chunk one register tile accumulates over: all of K when it is at most 2 x depth,
    else the largest multiple of 4 dividing K in [depth / 2, 2 x depth] (no padding), else
    depth (K padded up to a multiple of it)."""
    if k <= 2 * depth:
        return -(-k // 4) * 4
    fits = [t for t in range(4, 2 * depth + 1, 4) if k % t == 0 and t >= depth // 2]
    return max(fits) if fits else depth


def _vectorize_tile(sch: Any, block: Any, lanes: int) -> None:
    loops = sch.get_loops(block)
    last = _extent(sch, loops[-1])
    if last is not None and last % lanes == 0:
        sch.vectorize(sch.split(loops[-1], factors=[None, lanes])[1])


def elementwise(func: Any, target: Any) -> Any:
    """Injective functions: producers inlined into consumers, each remaining loop nest
    vectorized on its innermost loop and threaded when large."""
    from tvm import s_tir
    from tvm.s_tir.dlight import normalize_prim_func, try_inline
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None or not all(info.is_injective() for info in infos):
        return None
    lanes = _lanes(target)
    for info in try_inline(sch, infos):
        if not _transpose(sch, info.block_rv, lanes):
            _parallel_vectorize(sch, info.block_rv, lanes)
    return sch


def _transpose(sch: Any, block: Any, lanes: int) -> bool:
    """A block that reads some buffer along another loop than the one it writes along (a
    transpose, or a fused chain ending in one) is tiled in lanes x lanes squares: the read
    then uses whole cache lines and the write stays vectorized. False if `block` is not one."""
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    names = [iv.var for iv in stmt.iter_vars]
    if len(loops) != len(names) or len(loops) < 2 or any(iv.iter_type != 0
                                                         for iv in stmt.iter_vars):
        return False
    axis = None
    for region in stmt.reads:
        last = region.region[-1].min if region.region else None
        for pos, var in enumerate(names[:-1]):
            if last is not None and last.same_as(var):
                axis = pos
    extents = [_extent(sch, loops[p]) for p in (axis, -1)] if axis is not None else [None]
    if axis is None or any(e is None or e % lanes for e in extents):
        return False
    po, pi = sch.split(loops[axis], factors=[None, lanes])
    lo, li = sch.split(loops[-1], factors=[None, lanes])
    rest = [lp for n, lp in enumerate(loops[:-1]) if n != axis]
    sch.reorder(*rest, po, lo, pi, li)
    sch.vectorize(li)
    sch.parallel(sch.fuse(*rest, po, lo))
    return True


def reduction(func: Any, target: Any) -> Any:
    """Any other function with reductions: each block's spatial loops outside its reduction
    loops, the leading ones threaded; a trailing spatial loop stays innermost and vectorized
    (column sums such as bias gradients); injective blocks as in `elementwise`."""
    from tvm import s_tir
    from tvm.s_tir.dlight import normalize_prim_func, try_inline
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None or all(info.is_injective() for info in infos):
        return None
    lanes = _lanes(target)
    for info in try_inline(sch, infos):
        if info.is_injective():
            _parallel_vectorize(sch, info.block_rv, lanes)
        else:
            _reduction_block(sch, info, lanes)
    return sch


def _reduction_block(sch: Any, info: Any, lanes: int) -> None:
    loops = sch.get_loops(info.block_rv)
    kinds = info.dom_kind()
    if len(loops) != len(kinds):
        return
    spatial = [lp for lp, kind in zip(loops, kinds) if kind == "S"]
    reduce = [lp for lp, kind in zip(loops, kinds) if kind == "R"]
    if not reduce:
        return
    inner = spatial.pop() if kinds[-1] == "S" and len(spatial) > 0 else None
    if inner is not None and (_extent(sch, inner) or 0) < lanes:
        spatial.append(inner)  # too short to vectorize: plain row reduction
        inner = None
    sch.reorder(*spatial, *reduce, *([inner] if inner is not None else []))
    if inner is not None:
        sch.decompose_reduction(info.block_rv, reduce[0])
        extent = _extent(sch, inner)
        if extent is not None and extent % lanes == 0:
            sch.vectorize(sch.split(inner, factors=[None, lanes])[1])
    vector = (_extent(sch, inner) or 1) if inner is not None else 1
    if spatial and (_product(sch, spatial) or 0) * vector >= 64:
        sch.parallel(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0])


def rules() -> list[Any]:
    """glmc's CPU rule table, in the order tried (the first rule that schedules wins)."""
    from tvm.s_tir import dlight as dl
    return [_rule(matmul), dl.cpu.Reduction(), _rule(reduction), _rule(elementwise)]


def pipeline(target: Any) -> Any:
    """TVM's default CPU Relax pipeline with glmc's schedule rules applied after legalization
    and fusion (and before the dataflow is lowered)."""
    import tvm
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.s_tir import dlight as dl

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: Any, _ctx: Any) -> Any:
        with target:
            return tvm.transform.Sequential(
                cpu.library_dispatch_passes(target) + cpu.legalize_passes(target)
                + [dl.ApplyDefaultSchedule(*rules())]
                + cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target))(mod)

    return _pipeline
