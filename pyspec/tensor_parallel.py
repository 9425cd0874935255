"""Tensor parallelism of the target model across processes (``LLM(tensor_parallel_size=N)``).

Rank 0 is the LLM's own process: it runs the whole engine (scheduler, drafters, acceptance,
sampling) and its share of the target. Ranks 1..N-1 are worker processes that hold the other
shares and do what rank 0 tells them, in the same order: run a step's forward, materialize the
rows a request keeps, copy KV blocks. Every rank therefore verifies the very draft tree rank 0
proposed, and only rank 0 decides what is accepted: ranks cannot disagree about the tokens.

Each rank holds a contiguous run of the KV heads (with their query heads) and of the MLP's
intermediate columns: q/k/v and gate/up are split by rows (column parallel), o_proj and
down_proj by input columns (row parallel), followed by one all-reduce each, so every rank ends
each block with the same hidden state. Embeddings, norms and the LM head are replicated. The
KV pool is split by KV head: each rank's pool holds its own heads for every page. The
all-reduces use a gloo process group of this LLM alone (no process-wide default group), with a
timeout: a rank that dies or stops answering turns the step into an error instead of a hang.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import threading
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import torch

from pyspec.runner import KVPool, ModelRunner

READY_SECONDS = 300.0  # a worker's start (imports, loading its share)


def split_range(n: int, parts: int) -> List[Tuple[int, int]]:
    """``[0, n)`` in ``parts`` contiguous runs, sizes differing by at most one (earlier ones
    larger)."""
    q, r = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        out.append((start, stop))
        start = stop
    return out


def check_tensor_parallel(cfg, size) -> None:
    """``tensor_parallel_size`` for a model of config ``cfg``: an int in [1, KV heads]."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1; got {size!r}")
    if size > cfg.num_key_value_heads:
        raise ValueError(f"tensor_parallel_size={size} is more than the model's "
                         f"{cfg.num_key_value_heads} KV heads (each rank holds at least one)")
    if size > cfg.intermediate_size:
        raise ValueError(f"tensor_parallel_size={size} is more than the model's MLP width "
                         f"({cfg.intermediate_size})")


def shard_weights(weights: dict, cfg, rank: int, size: int):
    """Rank ``rank``'s share of a checkpoint's tensors (Hugging Face names, float) and the
    config of that share (its heads and MLP width)."""
    kv0, kv1 = split_range(cfg.num_key_value_heads, size)[rank]
    i0, i1 = split_range(cfg.intermediate_size, size)[rank]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    d = cfg.head_dim
    q_rows = slice(kv0 * group * d, kv1 * group * d)
    kv_rows = slice(kv0 * d, kv1 * d)
    out = {}
    for name, t in weights.items():
        if ".self_attn.q_proj." in name:
            t = t[q_rows]
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            t = t[kv_rows]
        elif name.endswith(".self_attn.o_proj.weight"):
            t = t[:, q_rows]
        elif name.endswith(".self_attn.o_proj.bias"):
            if rank:
                continue  # added once, by rank 0, before the all-reduce sums the shares
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            t = t[i0:i1]
        elif name.endswith(".mlp.down_proj.weight"):
            t = t[:, i0:i1]
        out[name] = t.contiguous()
    local = replace(cfg, num_attention_heads=(kv1 - kv0) * group,
                    num_key_value_heads=kv1 - kv0, intermediate_size=i1 - i0)
    return local, out


def load_shard(path: str, rank: int, size: int, dtype: str = "float32",
               packed_weights: str = "codes", kernels=None):
    """Rank ``rank``'s share of the model at ``path``, packed as ``from_pretrained`` packs
    (exact 4- / 8-bit matrices held as codes; shares cut on block boundaries stay exact)."""
    from pyspec.models.config import ModelConfig
    from pyspec.models.llama import LlamaForCausalLM
    from pyspec.models.loader import load_weights, resolve_dtype

    cfg = ModelConfig.from_file(path)
    check_tensor_parallel(cfg, size)
    dt = resolve_dtype(dtype)
    weights = load_weights(path, cfg, dt, "cpu", dequantize=True)
    local, weights = shard_weights(weights, cfg, rank, size)
    m = LlamaForCausalLM(local, weights, dt, "cpu", kernels=kernels)
    m.source_path = path
    off = packed_weights == "off" or os.environ.get("PYSPEC_PACKED_WEIGHTS", "1") == "0"
    if not off:
        m.pack_weights()
        if packed_weights == "codes":
            m.drop_dense()
    return m


def _group(host: str, port: int, rank: int, size: int, timeout: float):
    import torch.distributed as dist

    t = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, size, False, timeout=t)
    return dist.ProcessGroupGloo(store, rank, size, t)


def _portable(seqs) -> list:
    """A step's sequences for the pipe: draft trees (core objects) as their parents and tokens."""
    return [replace(s, tree=(list(s.tree.parents), list(s.tree.tokens)))
            if s.tree is not None else s for s in seqs]


def _rebuilt(seqs) -> list:
    from pyspec import TokenTree

    return [replace(s, tree=TokenTree(*s.tree)) if isinstance(s.tree, tuple) else s
            for s in seqs]


def _worker(rank, size, port, path, dtype, packed_weights, num_blocks, block_size, kv_dtype,
            threads, timeout, conn) -> None:
    """A rank > 0: its share of the model and of the KV pool, doing rank 0's commands."""
    os.environ["PYSPEC_NUM_THREADS"] = str(threads)  # (before the core's thread pool starts)
    torch.set_num_threads(threads)
    try:
        group = _group("127.0.0.1", port, rank, size, timeout)
        model = load_shard(path, rank, size, dtype, packed_weights)
        model.tp_group = group
        runner = ModelRunner(model, num_blocks, block_size, kv_dtype=kv_dtype)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    last = None
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            return
        op = cmd[0]
        try:
            if op == "step":
                last = runner.step(_rebuilt(cmd[1]), *cmd[2:])
            elif op == "commit":
                runner.commit_kv(last, *cmd[1:])
            elif op == "copy":
                runner.kv.copy_blocks(cmd[1])
            elif op == "stop":
                return
        except Exception:  # noqa: BLE001 - rank 0 met the same error (same inputs) or saw ours
            last = None


class _Workers:
    """Ranks 1..N-1: their processes and command pipes."""

    def __init__(self, size, port, path, dtype, packed_weights, num_blocks, block_size,
                 kv_dtype, threads, timeout):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, size):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_worker, daemon=True, name=f"pyspec-tp-rank{rank}", args=(
                rank, size, port, path, dtype, packed_weights, num_blocks, block_size,
                kv_dtype, threads, timeout, there))
            p.start()
            there.close()
            self.conns.append(here)
            self.procs.append(p)
        self.lock = threading.Lock()

    def wait_ready(self, seconds: float) -> None:
        for rank, (c, p) in enumerate(zip(self.conns, self.procs), start=1):
            if not c.poll(seconds):
                raise RuntimeError(f"tensor-parallel rank {rank} did not start within "
                                   f"{seconds:.0f} s")
            try:
                kind, detail = c.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting "
                                   f"(exit code {p.exitcode})") from None
            if kind != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def send(self, cmd) -> None:
        for rank, (c, p) in enumerate(zip(self.conns, self.procs), start=1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit code "
                                   f"{p.exitcode}); this LLM cannot run its model any more")
            c.send(cmd)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
            c.close()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


class _TPKVPool(KVPool):
    """Rank 0's KV pool: copy-on-write copies are done on every rank."""

    def __init__(self, k, v, workers):
        super().__init__(k, v)
        self._workers = workers

    def copy_blocks(self, pairs) -> None:
        pairs = list(pairs)
        self._workers.send(("copy", pairs))
        super().copy_blocks(pairs)


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: each call is sent to the other ranks, then run on rank 0's share
    (the all-reduces inside its forward meet theirs). A collective that fails (a rank died, or
    timed out) leaves the group unusable: every later step raises."""

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype, workers: _Workers):
        super().__init__(model, num_blocks, block_size, kv_dtype=kv_dtype)
        self.tensor_parallel_size = len(workers.procs) + 1
        self.kv = _TPKVPool(self.kv.k, self.kv.v, workers)
        self._workers = workers
        self._broken: Optional[str] = None

    def _run(self, cmd, local):
        if self._broken:
            raise RuntimeError(f"the tensor-parallel group failed earlier ({self._broken}); "
                               "create the LLM again")
        with self._workers.lock:
            self._workers.send(cmd)
            try:
                return local()
            except ValueError:
                raise  # bad input: every rank refused it the same way, before any collective
            except Exception as e:
                self._broken = f"{type(e).__name__}: {e}"
                raise RuntimeError(f"tensor-parallel step failed: {self._broken}") from e

    def step(self, seqs: Sequence, return_hidden=False, inputs_embeds=None, *,
             logits_to_host: bool = True):  # (a CPU model's logits are on the host)
        seqs = list(seqs)
        return self._run(("step", _portable(seqs), return_hidden, inputs_embeds),
                         lambda: super(TensorParallelRunner, self).step(
                             seqs, return_hidden, inputs_embeds))

    def commit_kv(self, out, seq_index: int, local_rows, slots) -> None:
        local_rows, slots = list(map(int, local_rows)), list(map(int, slots))
        self._run(("commit", seq_index, local_rows, slots),
                  lambda: super(TensorParallelRunner, self).commit_kv(
                      out, seq_index, local_rows, slots))

    def close(self) -> None:
        self._workers.close()


def start(path: str, size: int, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
          dtype: str, packed_weights: str, kernels=None, timeout: float = 60.0,
          threads: Optional[int] = None) -> TensorParallelRunner:
    """Start ranks 1..size-1 and return rank 0's runner over its own share of ``path``.
    ``kv_dtype``: the KV cache's dtype (resolved). ``threads``: the core threads of each worker
    rank (default: this machine's CPUs / size). ``timeout``: seconds a collective may wait for
    the other ranks before the step fails."""
    import torch.distributed as dist

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"tensor-parallel timeout must be a number of seconds > 0; got "
                         f"{timeout!r}")
    threads = threads or max(1, (os.cpu_count() or 1) // size)
    t = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=t,
                          wait_for_workers=False)  # rank 0 serves it
    workers = _Workers(size, store.port, path, dtype, packed_weights, num_blocks, block_size,
                       kv_dtype, threads, timeout)
    try:
        model = load_shard(path, 0, size, dtype, packed_weights, kernels)  # (while they start)
        model.tp_group = dist.ProcessGroupGloo(store, 0, size, t)
        workers.wait_ready(READY_SECONDS)
        runner = TensorParallelRunner(model, num_blocks, block_size, kv_dtype, workers)
    except BaseException:
        workers.close()
        raise
    runner._store = store  # (kept alive with the group)
    return runner
