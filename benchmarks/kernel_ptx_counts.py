"""Instructions per tile of the block-score kernel's main loop, read from its sm90 PTX.

Compiles ``kernels/block_scores.py`` for an H100/H200 target (no GPU needed: Triton stops at
PTX) at Qwen3-8B's shapes (GQA 32/8 x 128, block 32, fp8 summaries, the GPU launch's 64 blocks
per tile, 4 tiles per program, 3 stages) once per precision, and counts the PTX instructions
of the pipelined tile loop (the basic block its back edge jumps to), with the most frequent
opcodes. Integer arguments get the divisibility-by-16 hints a real launch gives them.

    python benchmarks/kernel_ptx_counts.py [--precisions tc,tc_fp16] [--json OUT]
    python benchmarks/kernel_ptx_counts.py --shared 128x576 4x128   # the launch's shared memory
"""

from __future__ import annotations

import argparse
import collections
import json
import re

QWEN3_8B = dict(BLOCK_SIZE=32, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_D=128, D_CHUNKS=1,
                BLOCK_NB=64, INTERPRET=False, HEADS_PER_PROGRAM=1, HEADS_FASTEST=False,
                TILES_PER_PROGRAM=4, SKIP_DEAD_TILES=True)
SIGNATURE = dict(Q="*bf16", KMIN="*fp8e4nv", KMAX="*fp8e4nv", REQ_TO_TOKEN="*i32",
                 REQ_POOL_INDICES="*i64", SEQ_LENS="*i64", OUT="*fp32", max_blocks="i32",
                 sink="i32", window="i32", stride_qb="i32", stride_qh="i32", stride_sp="i32",
                 stride_sh="i32", stride_r2t="i32", stride_ob="i32", stride_oh="i32")
# what a launch specializes as divisible by 16 (pointers, strides, the grid's block count)
DIVISIBLE = ("Q", "KMIN", "KMAX", "REQ_TO_TOKEN", "REQ_POOL_INDICES", "SEQ_LENS", "OUT",
             "max_blocks", "stride_qb", "stride_qh", "stride_sp", "stride_sh", "stride_r2t",
             "stride_ob", "stride_oh")


def compile_block_scores(precision: str, shapes: dict, num_stages: int,
                         summaries: str = "*fp8e4nv"):
    """The block-score kernel compiled for sm_90 at these constexpr shapes (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_ext.kernels.block_scores import _quest_block_scores_kernel

    constexprs = dict(shapes, PRECISION=precision)
    signature = dict(SIGNATURE, KMIN=summaries, KMAX=summaries,
                     **{name: "constexpr" for name in constexprs})
    names = list(SIGNATURE)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    source = ASTSource(_quest_block_scores_kernel, signature=signature, constexprs=constexprs,
                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=num_stages))


def block_score_ptx(precision: str) -> str:
    from sglang_ext.kernels.block_scores import TC_NUM_STAGES

    return compile_block_scores(precision, QWEN3_8B, TC_NUM_STAGES).asm["ptx"]


def launch_shared_bytes(group: int, head_dim: int, block_size: int = 16) -> int:
    """Shared memory of the tensor-core launch the wrapper makes for bf16 summaries at this
    GQA group and head dim (its tiling and stage choice), compiled for sm_90."""
    import triton

    from sglang_ext.kernels.block_scores import TC_BLOCK_NB, tc_num_stages
    from sglang_ext.kernels.sparse_attention import head_dim_tiling

    block_d, d_chunks = head_dim_tiling(head_dim)
    shapes = dict(QWEN3_8B, BLOCK_SIZE=block_size, GROUP=group,
                  GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                  BLOCK_D=block_d, D_CHUNKS=d_chunks, BLOCK_NB=TC_BLOCK_NB, TILES_PER_PROGRAM=1)
    compiled = compile_block_scores("tc", shapes, tc_num_stages(group, block_d, d_chunks),
                                    summaries="*bf16")
    return int(compiled.metadata.shared)


def loop_instructions(ptx: str) -> collections.Counter:
    """Opcodes of the loop body: the basic block a backward conditional branch jumps to, up
    to the next label."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    head = None
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            head = labels[m.group(1)]
            break
    if head is None:
        raise RuntimeError("no loop found in the PTX")
    ops: collections.Counter = collections.Counter()
    for line in lines[head + 1:]:
        text = line.strip()
        if text.startswith("$L__BB"):
            break
        if not text or text.startswith(("//", ".", "{", "}", "$")):
            continue
        ops[re.sub(r"^@!?%p\d+\s+", "", text).split()[0].rstrip(";")] += 1
    return ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precisions", default="tc,tc_fp16")
    p.add_argument("--json", default=None, help="write the counts here")
    p.add_argument("--shared", nargs="+", default=None, metavar="GROUPxDIM",
                   help="instead: the launch's shared memory at these query heads per kv head "
                   "and head dims (e.g. 128x576, DeepSeek-V3's MLA at TP 1)")
    args = p.parse_args(argv)
    if args.shared:
        shared = {}
        for shape in args.shared:
            group, head_dim = (int(x) for x in shape.split("x"))
            shared[shape] = launch_shared_bytes(group, head_dim)
            print(f"{shape:10s} {shared[shape]:7d} bytes of shared memory", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(target="sm90", shared_bytes=shared), f, indent=1)
        return 0
    out = {}
    for precision in args.precisions.split(","):
        ops = loop_instructions(block_score_ptx(precision))
        out[precision] = dict(loop_instructions=sum(ops.values()), ops=ops.most_common())
        print(f"{precision:8s} {sum(ops.values()):5d} PTX instructions per tile  "
              + ", ".join(f"{op} {n}" for op, n in ops.most_common(6)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shapes=QWEN3_8B, target="sm90", precisions=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
