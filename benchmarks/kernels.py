"""Triton kernels vs their PyTorch references on a GPU, at real sizes; bandwidth as a fraction of the device's copy
bandwidth measured in the same run.

    python benchmarks/kernels.py            # needs CUDA and triton; writes results/kernels-<gpu>.json
    python benchmarks/kernels.py --smoke    # on the CPU: every kernel checked at tiny shapes under TRITON_INTERPRET=1

`run(device, ...)` does the work (benchmarks/gpu.py calls it too, and, untimed at tiny shapes, on the CPU under
TRITON_INTERPRET=1).

For each kernel and shape: median time of kernel and reference (triton.testing.do_bench), speedup, bytes the kernel
must read at least once, and achieved / copy bandwidth. Outputs are checked equal to the reference first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="check every kernel against its reference on the CPU at "
                        "tiny shapes, untimed (Triton's interpreter)")
    if parser.parse_args().smoke:
        return smoke()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU (the kernels' CPU tests run under TRITON_INTERPRET=1).")
    result = run(torch.device("cuda"))
    name = torch.cuda.get_device_name().replace(" ", "_")
    out = Path(f"results/kernels-{name}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"device copy bandwidth {result['copy_GBs']:.0f} GB/s; wrote {out}")


def smoke() -> None:
    os.environ["TRITON_INTERPRET"] = "1"           # before triton is imported
    result = run(torch.device("cpu"), vocabs=(64,), batches=(1, 3), widths=(1, 3), caches=((2, 2, 16, 8),),
                 timed=False)
    print(f"{len(result['rows'])} kernel/shape pairs equal to their references on the CPU (Triton's interpreter); "
          "skipped: the timing and the bandwidth, which need CUDA")


def run(dev, vocabs=(32000, 151936), batches=(1, 16, 64), widths=(1, 4, 8),
        caches=((1, 8, 4096, 128), (16, 8, 2048, 128), (64, 8, 1024, 128)), timed=True) -> dict:
    """Every kernel checked equal to its reference at each shape and, `timed`, both timed (triton.testing.do_bench,
    CUDA only). Returns {"copy_GBs": the device's copy bandwidth or None, "rows": one dict per kernel and shape}."""
    from spec_adapt import acceptor
    from spec_adapt.acceptance_rules import greedy_accept, rejection_sample, sample_randoms
    from spec_adapt.kernels.compact import gather_slots
    from spec_adapt.kernels.verify import greedy_verify, rejection_verify, token_rank, token_rank_reference

    copy_bw = None
    if timed:
        from triton.testing import do_bench

        big = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
        copy_ms = do_bench(lambda: big.clone())
        copy_bw = 2 * big.numel() / (copy_ms * 1e-3)            # read + write, bytes/s
        del big
    rows = []

    def record(name, shape, kernel, reference, bytes_read):
        if not timed:                                       # checked equal above: that is the untimed run
            rows.append({"kernel": name, "shape": shape, "equal": True})
            return
        k_ms, r_ms = do_bench(kernel), do_bench(reference)
        bw = bytes_read / (k_ms * 1e-3)
        rows.append({"kernel": name, "shape": shape, "kernel_ms": k_ms, "torch_ms": r_ms, "speedup": r_ms / k_ms,
                     "bandwidth_GBs": bw / 1e9, "fraction_of_copy": bw / copy_bw})
        print(f"{name:<10} {str(shape):<28} kernel {k_ms:8.4f} ms  torch {r_ms:8.4f} ms  x{r_ms / k_ms:5.2f}  "
              f"{bw / 1e9:7.1f} GB/s ({100 * bw / copy_bw:4.0f}% of copy)")

    for vocab in vocabs:
        for batch in batches:
            for s in widths:
                logits = torch.randn(batch, s + 1, vocab, device=dev, dtype=torch.bfloat16)
                target = logits.float().argmax(-1)
                drafts = target[:, :s].clone()
                drafts[:, s // 2:] = (drafts[:, s // 2:] + 1) % vocab   # reject half-way: half the logits read
                lengths = torch.full((batch,), s, device=dev)
                assert all(torch.equal(a, b) for a, b in zip(greedy_verify(logits, drafts, lengths),
                                                             greedy_accept(logits, drafts, lengths)))
                record("greedy", (batch, s, vocab), lambda: greedy_verify(logits, drafts, lengths),
                       lambda: greedy_accept(logits, drafts, lengths), logits[:, : s // 2 + 1].numel() * 2)
                p = logits.float().softmax(-1)
                q = torch.randn_like(logits[:, :s]).float().softmax(-1)
                u, e = sample_randoms(batch, s, vocab, dev)
                assert all(torch.equal(a, b) for a, b in zip(rejection_verify(p, drafts, q, lengths, u, e),
                                                             rejection_sample(p, drafts, q, lengths, u, e)))
                record("rejection", (batch, s, vocab), lambda: rejection_verify(p, drafts, q, lengths, u, e),
                       lambda: rejection_sample(p, drafts, q, lengths, u, e), 4 * batch * vocab * 3)
            logits = torch.randn(batch * 8, vocab, device=dev, dtype=torch.bfloat16)
            tokens = torch.randint(0, vocab, (batch * 8,), device=dev)
            assert torch.equal(token_rank(logits, tokens), token_rank_reference(logits, tokens))
            record("rank", (batch * 8, vocab), lambda: token_rank(logits, tokens),
                   lambda: token_rank_reference(logits, tokens), logits.numel() * 2)
    for batch, heads, length, dim in caches:
        cache = torch.randn(batch, heads, length, dim, device=dev, dtype=torch.bfloat16)
        index = torch.sort(torch.rand(batch, length, device=dev), dim=1).indices[:, : length * 3 // 4].sort(1).values
        assert torch.equal(gather_slots(cache, index), acceptor.gather_slots_reference(cache, index))
        record("compact", (batch, heads, length, dim), lambda: gather_slots(cache, index),
               lambda: acceptor.gather_slots_reference(cache, index), 2 * cache[:, :, : index.shape[1]].numel() * 2)
    return {"copy_GBs": None if copy_bw is None else copy_bw / 1e9, "rows": rows}


if __name__ == "__main__":
    main()
