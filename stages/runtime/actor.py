"""StageActor: one pipeline stage, one device, one Ray actor.

Life of a stage:
  1. `probe(path)`      before any weight is loaded: the device (name, total/free bytes, node),
                         the measured ms per dense layer and per missed expert at the model's real
                         dimensions (a layer whose files are on this node), and which of the
                         model's files (parts) are here.
  2. `connect(...)`     join the stages' process group (activations go stage to stage over it).
  3. `check_parts(...)` once planned: the size and sampled hash of each file its layers need, as
                         this node sees it (the driver compares the nodes and names what is missing).
  4. `load(...)`        load only layers [first, end) (+ embedding / head), mapping only the files
                         holding them, and allocate the KV pool.
  5. `step(batch)`      run one micro-batch through this stage's layers (StageRunner).

The driver hands each call the model's header (metadata and every part's tensor directory, as it
read them): a node needs only the files its stage reads, not the others' headers. It computes as
the StageOptions it is constructed with say (stages/kernels/settings.py: backend, threads,
layouts, graphs): the driver's, sent to every stage whatever node it runs on. Its own environment
is never read; `options()` reports what it runs with.

The class is plain Python; the driver wraps it with `ray.remote` when it spawns stages, so
unit tests can also drive it in-process. What it takes and reports (StepBatch, StepOutput,
ProbeReport, LoadReport, StageStats) is the step's contract, stages/runtime/step.py: the driver
reads fields, the HTTP API turns them into JSON at its edge.
"""
from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from dataclasses import asdict
from typing import Any

import torch

from moeray.cache.attach import routing_trace
from moeray.errors import MoerayError
from moeray.planner.kv import host_tier_room
from moeray.stages.arch import arch_of
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, kv_block_bytes, kv_dtype, kv_stats, stage_kv_types
from moeray.stages.gguf.reader import GGUFFile, read_gguf_header
from moeray.stages.kernels import repack, settings
from moeray.stages.kernels.backend import current_backend, ggml_available
from moeray.stages.kernels.ggml_lib import sgemm_built, tiled_gemm
from moeray.stages.kernels.settings import StageOptions
from moeray.stages.kernels.threads import ggml_threads, rest_threads, thread_settings
from moeray.stages.runtime.device import (DeviceInfo, device_ledger, host_threads_for_stage, measure_speed,
                                          probe_device)
from moeray.stages.runtime.draft_model import DraftModel
from moeray.stages.runtime.heap import FrozenAfterBuilds, freeze_heap
from moeray.stages.runtime.model import load_cached, stage_trunk_bytes
from moeray.stages.runtime.mtp import MTPHead, mtp_bytes
from moeray.stages.runtime.runner import StageRunner
from moeray.stages.runtime.step import FileFingerprint, LoadReport, ProbeReport, StageStats, StepBatch, StepOutput
from moeray.stages.runtime.transport import StageLink, free_port
from moeray.stages.runtime.trunk_graph import MultiGraph

# Ray is imported only inside the two methods that call it (node_ip, relay): in process
# (`moeray serve --local`, bench/inproc.py) the class runs without it.

STEP_TIMINGS = 256  # the last steps whose times a stage keeps (StageStats.timings)


def file_fingerprint(path: str, n_samples: int = 16, block: int = 1 << 16) -> FileFingerprint:
    """Size and a sampled sha256 (head, tail and evenly spaced blocks) of a file.

    A full hash of a 100 GB model would take minutes per node; sampled blocks catch a
    different file, a different quantisation, and a truncated or partial copy.
    """
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        offsets = sorted({0, max(0, size - block), *(i * size // n_samples for i in range(n_samples))})
        for off in offsets:
            f.seek(off)
            h.update(f.read(block))
    return FileFingerprint(size, h.hexdigest())


def parts_here(header) -> list[int]:
    """The model's files (0-based parts) present here at full length (a cheap stat each)."""
    return [p.index for p in header.parts if os.path.exists(p.path) and os.path.getsize(p.path) >= p.data_end]


def _split(carry: list[int], batch: StepBatch) -> list[list[int]]:
    """The last stage's view of the draft model's tokens: each drafting row's k of them, in row order."""
    out, at = [], 0
    for k in batch.draft_k or [0] * len(batch.slots):
        out.append(carry[at:at + k] if k > 0 else [])
        at += max(k, 0)
    return out


def _nvml_process_bytes(pci_bus_id: str) -> tuple[int | None, str]:
    """NVML's used memory of this process on the card at `pci_bus_id` (context and allocator
    cache included), or None and the reason (no NVML; another PID namespace hides our pid)."""
    try:
        import pynvml  # inside the try: NVML missing or refusing is reported, never fatal

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid():
                    return (None if p.usedGpuMemory is None else int(p.usedGpuMemory)), "nvml"
            return None, f"NVML lists no process {os.getpid()} on {pci_bus_id} (a container's PID namespace?)"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - reported beside torch's numbers, never fatal
        return None, f"NVML: {type(exc).__name__}: {exc}"


class StageActor:
    def __init__(self, stage: int, n_stages: int, simulated_budget: int | None = None,
                 torch_threads: int | None = None, options: StageOptions | None = None, card_share: float = 1.0):
        if options is not None:  # the driver's decision: this process's, whatever its environment says
            settings.use(options)
        if torch_threads is None and simulated_budget is None:
            # A CUDA stage computes its misses on the host, but Ray starts an actor that reserves no
            # CPU with OMP_NUM_THREADS=1: give it its part of the node's cores instead.
            torch_threads = host_threads_for_stage(card_share, n_stages)
        if torch_threads:
            # Simulated stages share the host's cores; without this each grabs all of them.
            torch.set_num_threads(torch_threads)
        self.stage, self.n_stages = stage, n_stages
        self._loop_tokens = None  # a one-stage pipeline's looped tokens, kept for its next step
        self.simulated_budget = simulated_budget
        self.card_share = card_share  # the part of its GPU Ray gave this stage (0.5: two stages per card)
        self.device: DeviceInfo = probe_device(simulated_budget, index=stage, card_share=card_share)
        self.memory = device_ledger(self.device, stage)
        self.link = None
        self.model = None

    def __repr__(self) -> str:
        """Who this stage is, e.g. `StageActor(stage=1/4, layers=7-16, hit=93%)`.

        Ray records an actor's repr once, when its constructor returns: that is the name the Ray
        dashboard's actor table and the `(StageActor(stage=1/4, ...) pid=...)` log prefix show, so
        there it names the stage and its device (layers are planned after the probe). Read later
        (ray.get(actor.describe.remote()), logs, tests) it carries the live layers and hit rate.
        """
        parts = [f"stage={self.stage}/{self.n_stages}"]
        if self.model is None:
            parts.append(f"device={self.device.name}")
        else:
            parts.append(f"layers={self.model.first}-{self.model.end - 1}")
            hit_rate = getattr(self.model.experts, "hit_rate", None)
            if callable(hit_rate):
                parts.append(f"hit={100 * hit_rate():.0f}%")
        return f"StageActor({', '.join(parts)})"

    def describe(self) -> str:
        """repr(self), for callers on the other side of Ray (whose handles repr as ActorHandle)."""
        return repr(self)

    def options(self) -> dict[str, Any]:
        """The StageOptions this stage computes with, each as its kernels resolve it now: the
        backend "auto" names the one it picked, threads the count ggml runs, ggml_tiled whether its
        ggml takes llama.cpp's tiled GEMM (docs/kernels.md#tiled-gemm), ggml_sgemm whether it has
        llamafile's sgemm; `run_path` the
        loaded layers' (StageModel.path), None before loading."""
        out = settings.current().as_dict()
        ts = thread_settings()
        out.update(backend=current_backend(), repack=repack.mode(), host_experts=repack.host_experts(),
                   ggml_poll=ts.poll, ggml_parallel_kb=ts.parallel_bytes >> 10, ggml_adapt=ts.adapt)
        if ggml_available():
            out["threads"] = ggml_threads()
            out["ggml_tiled"] = tiled_gemm()  # llama.cpp's tiled K/IQ-quant GEMM: on, off or absent
            out["ggml_sgemm"] = sgemm_built()  # llamafile's sgemm built in (taken at sgemm_rows+ rows)
        out["run_path"] = None if self.model is None else asdict(self.model.path)
        return out

    # ---------------------------------------------------------------- before loading

    def probe(self, path: str, header=None, kv_host: str = "auto") -> ProbeReport:
        """Everything the planner needs from this stage, measured here, before any weight is loaded.
        `header`: the model's (the driver's reading), else read from `path` on this node; `kv_host`:
        the host tier's size (LaunchOptions.kv_host), measured against this node's memory."""
        t = time.perf_counter()
        header = header or read_gguf_header(path)
        here = parts_here(header)
        where = f"stage {self.stage} on {self.device.node_ip or self.device.hostname}"
        if not here:
            raise MoerayError(f"{header.parts[0].path}: {where} finds none of the model's "
                              f"{len(header.parts)} file(s) there; copy the files its layers need to that path on "
                              "that node (`moeray plan` lists each stage's parts), or mount them there")
        within = [l for l in range(header.config.n_layers) if set(header.stage_parts(l, l + 1)) <= set(here)]
        if not within:
            raise MoerayError(f"{header.parts[0].path}: {where} holds parts {', '.join(str(i + 1) for i in here)} of "
                              f"{len(header.parts)}, no whole layer to time; copy the parts of its layers there "
                              "(`moeray plan` lists each stage's parts)")
        speed = measure_speed(GGUFFile(path, header, parts=()), self.device.torch_device,
                              within=None if len(within) == header.config.n_layers else within)
        if self.device.kind == "cuda":
            torch.cuda.empty_cache()  # hand the timing's scratch back before reading free memory
        self.device = probe_device(self.simulated_budget, index=self.stage,  # free memory now, after timing
                                   card_share=self.card_share)
        self.memory = device_ledger(self.device, self.stage)
        host_room = host_tier_room(kv_host, repack.mem_available(), sum(header.parts[i].size for i in here), where)
        return ProbeReport(self.stage, os.getpid(), self.device, speed.layer_ms, speed.miss_ms,
                           time.perf_counter() - t, here, host_room)

    def check_parts(self, header, parts: list[int]) -> dict[int, FileFingerprint | str]:
        """Each of the model's files `parts` (0-based) as this node sees it: its size and sampled
        hash, or what is wrong with it (missing, cut short, another file under its name)."""
        g = GGUFFile(header.path, header, parts=())
        out: dict[int, FileFingerprint | str] = {}
        for i in parts:
            try:
                g.check_part(i)
            except MoerayError as exc:
                out[i] = str(exc)
                continue
            out[i] = file_fingerprint(header.parts[i].path)
        return out

    def node_ip(self) -> str:
        import ray  # only here and in relay: see the note after the imports

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    # ---------------------------------------------------------------- wiring

    def connect(self, master_addr: str, master_port: int, timeout_s: float = 30.0,
                backend: str | None = None) -> int:
        """Join the stages' process group. backend: the driver's choice for the whole group
        (transport.link_backend: gloo when stages share a card); None: nccl on CUDA, else gloo."""
        backend = backend or ("nccl" if self.device.kind == "cuda" else "gloo")
        self.link = StageLink(master_addr, master_port, self.stage, self.n_stages, timeout_s, backend,
                              compute_device=self.device.torch_device)
        self._loop_tokens = None  # a chain of decode steps does not outlive its process group
        return self.stage

    def ping(self) -> int:
        return os.getpid()

    # ---------------------------------------------------------------- loading and running

    def load(self, path: str, first: int, end: int, kv_blocks: int,
             trunk_on_card: int | None = None, profile: str | None = None,
             cache_policy: str = "static", state_slots: int = 1, whole_cache_only: bool = False,
             state_checkpoints: int = 0, header=None, draft: str | None = None, mtp: bool = False,
             host_checkpoints: int = 0, kv_types: tuple[str, str] | None = None,
             host_blocks: int = 0) -> LoadReport:
        """Load layers [first, end) (+ embedding / head at the ends) and allocate a KV pool of
        `kv_blocks` blocks (stages/blocks/kv_cache.py) and, for recurrent (DeltaNet) layers, `state_slots`
        sequence states (one per engine sequence slot: stages/blocks/deltanet.py) and
        `state_checkpoints` more (cluster/state_checkpoints.py), charging all of it to this device's
        budget (a simulated device refuses what does not fit); `host_checkpoints` more checkpoints in
        host memory (numbered after those), not charged; `kv_types`: the plan's cache types of
        its K and V rows (None: this stage's options'); `host_blocks`: KV blocks of its host tier
        (stages/blocks/host_kv.py), not charged to the device either.

        `trunk_on_card` is the trunk the plan put on the card, in the bytes the planner priced
        (as stored in the GGUF); None charges the resident size of everything loaded. Routed
        experts are not loaded: they stay in the file mapping, and what is left of the device
        after KV and trunk becomes this stage's expert cache, filled hottest-first from `profile`
        (a path every node can read; None = uniform) and kept by `cache_policy`.

        `whole_cache_only` (`moeray serve --local`): cache the experts only when the room left holds
        every one of them (stages/runtime/model.py load_cached, the one stage builder, says why).

        `header`: the model's (the driver's reading), else read from `path`. Only the files (parts)
        holding this stage's tensors are checked and mapped.
        """
        t = time.perf_counter()
        self.model = None
        self.memory = device_ledger(self.device, self.stage)
        header = header or read_gguf_header(path)
        gguf = GGUFFile(path, header, parts=header.stage_parts(first, end))
        cfg = gguf.config
        # Charge KV and trunk from the header first: what is left is the expert cache's budget, and
        # the MoE blocks are built with that cache in front of the host copy.
        types = stage_kv_types(cfg, range(first, end), self.device.torch_device, kv_types)
        self.memory.charge(kv_blocks * kv_block_bytes(cfg, range(first, end), types),
                           f"KV pool ({kv_blocks} blocks, {kv_blocks * BLOCK_SIZE} tokens, {types.label})")
        itemsize = 2 if kv_dtype(self.device.torch_device).itemsize == 2 else 4  # the draft model's and MTP's pools
        state = (state_slots + state_checkpoints) * sum(arch_of(cfg).state_bytes(cfg, l) for l in range(first, end))
        if state:
            self.memory.charge(state, f"DeltaNet state ({state_slots} sequence slots, {state_checkpoints} checkpoints)")
        trunk = stage_trunk_bytes(gguf, first, end)
        self.memory.charge(trunk if trunk_on_card is None else trunk_on_card, f"trunk of layers {first}-{end - 1}")
        drafter = None
        if draft is not None:  # speculative decoding's draft model: on the first stage, charged like trunk
            if first != 0:
                raise MoerayError(f"stage {self.stage}: a draft model runs on the first stage only")
            drafter = DraftModel(draft, self.device.torch_device, kv_blocks, cfg)
            self.memory.charge(drafter.nbytes(), f"draft model {os.path.basename(draft)} (weights and KV)")
        if mtp:  # speculative decoding's next-token-prediction layer, on the last stage: priced from the
            if end != cfg.n_layers:
                raise MoerayError(f"stage {self.stage}: the next-token-prediction layer runs on the last stage only")
            self.memory.charge(mtp_bytes(header, kv_blocks, max(1, state_slots), itemsize, first == 0),
                               "next-token-prediction layer (weights and KV)")
        model, cache = load_cached(gguf, (first, end), self.device.torch_device, budget_bytes=self.memory.free,
                                   profile=profile, policy=cache_policy, layout="per-layer",
                                   whole_cache_only=whole_cache_only)
        if cache is not None:
            self.memory.charge(cache.budget.capacity, f"expert cache ({cache.slots.n_slots} slots)")
        resident = model.trunk_bytes()
        if resident > trunk:  # the header's price is the runtime's size by construction; say so if not
            raise MoerayError(f"stage {self.stage}: the trunk of layers {first}-{end - 1} holds {resident} bytes, "
                              f"{trunk} were charged")
        kv = model.new_kv_pool(kv_blocks, state_slots + state_checkpoints, host_checkpoints, types, host_blocks)
        self.model, self.runner = model, StageRunner(model, kv)
        self.runner.drafter = drafter
        if mtp:
            self.runner.mtp = MTPHead(model, kv_blocks, max(1, state_slots))
        self.runner.share_host_tier()
        # Fixed once loaded: measured here, not again on every stats poll.
        self.trunk_bytes = (resident, stage_trunk_bytes(gguf, first, end, backend=None))
        self.steps, self.step_s, self.tokens_in = 0, 0.0, 0
        # The last steps' times (step id, call start, input ready, layers done, output sent or
        # sampled; perf_counter_ns): per-hop times in GET /v1/stages (cluster/timeline.py stage_hops)
        self.timings: deque[tuple[int, int, int, int, int]] = deque(maxlen=STEP_TIMINGS)
        self.hidden = model.config.hidden
        # What was loaded stays: out of the garbage collector's walks, and each graph once built (heap.py)
        freeze_heap()
        self.heap = FrozenAfterBuilds(MultiGraph.built)
        return LoadReport(self.stage, (first, end), time.perf_counter() - t, dict(self.memory.parts),
                          self.memory.free, resident, cache.slots.n_slots if cache else 0,
                          cache.core.n_resident if cache else 0, drafter.token_ms() if drafter else 0.0,
                          self.runner.mtp.token_ms() if self.runner.mtp else 0.0)

    def step(self, batch: StepBatch) -> StepOutput | None:
        """Run one micro-batch through this stage. The last stage returns its StepOutput (a token
        per sequence, None where the sequence is still mid-prompt); the others send their
        activations on and return None."""
        if self.model is None:
            raise MoerayError(f"stage {self.stage}: step before load")
        first, last = self.stage == 0, self.stage == self.n_stages - 1
        n_rows = sum(batch.n_new)
        sent = False
        t0 = time.perf_counter_ns()
        self.steps += 1
        self.tokens_in += n_rows
        try:
            if first and batch.looped is not None:  # the last stage's tokens of the step before, first thing
                batch = batch.with_looped(dict(zip(batch.looped, self._looped_tokens(len(batch.looped)))))
            meta = self.runner.begin(batch)
            carry = None  # the draft model's tokens, from the first stage to the last (StageLink)
            if first:
                drafts = self.runner.draft(batch)
                if drafts is not None:
                    batch = batch.model_drafted(drafts)
                    carry = [t for d, k in zip(drafts, batch.draft_k) if k > 0 for t in d]
                x = self.model.embed(batch.tokens)
            else:
                x, carry = self.link.recv(n_rows, self.hidden, carried=True)
            if carry and last and not first:  # the drafted tokens, in the order of the rows that drafted them
                batch = batch.model_drafted(_split(carry, batch))
            t_in = time.perf_counter_ns()
            x = self.runner.layers(x, meta, batch if last else None)
            t_layers = time.perf_counter_ns()
            if not last:
                sent = True
                self.link.send(x, carry)
                self.timings.append((batch.step_id, t0, t_in, t_layers, time.perf_counter_ns()))
                return None
            out = self.runner.sample(batch, x, meta)
            if batch.loop_back:  # to the first stage, for the step that continues this one
                sampled = [t for t, want in zip(out.tokens, batch.sample) if want]
                if first:
                    self._loop_tokens = sampled
                else:
                    self.link.send_tokens(sampled)
            t_out = time.perf_counter_ns()
            out.sample_ns = t_out - t_layers
            self.timings.append((batch.step_id, t0, t_in, t_layers, t_out))
            return out
        except Exception:
            if not last and not sent and self.link is not None:
                try:  # let the stages after this one fail this step now instead of timing out
                    self.link.send_failure(n_rows, self.hidden)
                except Exception:
                    pass
            raise
        finally:
            if self.n_stages > 1 and ggml_available():
                # Its part of the step is done: its ggml workers sleep now rather than spin on
                # while the next stage computes, on the same cores where stages share a host.
                rest_threads()
            self.step_s += (time.perf_counter_ns() - t0) / 1e9
            self.heap.after_step(MultiGraph.built)
            writer = getattr(self.model.experts, "trace_writer", None)
            if writer is not None:  # whole steps on disk: a stage killed later loses none of them
                writer.flush()

    def _looped_tokens(self, n: int) -> list[int]:
        """The first stage: the last stage's sampled tokens of the step before (this stage's own
        when it is the only one)."""
        if self.n_stages == 1:
            tokens, self._loop_tokens = self._loop_tokens, None
            if tokens is None or len(tokens) != n:
                raise MoerayError(f"stage 0: a step continues one whose {n} tokens it does not hold")
            return tokens
        return self.link.recv_tokens(n)

    def device_memory(self) -> dict[str, Any]:
        """What this stage was charged against what its device really holds: the ledger's parts
        (what the plan priced), the bytes its tensors hold (trunk, KV cache, filled slots), and on
        CUDA torch's allocator (now and peak) and NVML's count for this process (its context
        included). bench/device_check.py compares them."""
        out: dict[str, Any] = {"stage": self.stage, "device": self.device.torch_device,
                               "charged": dict(self.memory.parts), "charged_bytes": self.memory.used,
                               "reserve_bytes": self.device.reserve_bytes, "card_share": self.device.card_share}
        if self.model is not None:
            cache = self.model.experts
            slots = getattr(cache, "budget", None)
            out["held"] = {"trunk": self.model.trunk_bytes(), "kv": self.runner.kv.nbytes(),
                           "slots": slots.used if slots is not None else 0}
            out["held_bytes"] = sum(out["held"].values())
        if self.device.kind == "cuda":
            dev = torch.device(self.device.torch_device)
            out["torch_allocated_bytes"] = torch.cuda.memory_allocated(dev)
            out["torch_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
            out["torch_reserved_bytes"] = torch.cuda.memory_reserved(dev)
            out["nvml_process_bytes"], out["nvml_note"] = _nvml_process_bytes(self.device.pci_bus_id)
        return out

    def reset_peak_memory(self) -> None:
        """Start the device's peak count afresh (CUDA), e.g. before a measured run."""
        if self.device.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(torch.device(self.device.torch_device))

    def warm_grammars(self) -> None:
        """A server's last stage, once loaded: its grammar masks (their tokenizer, on this thread,
        the steps' own) and the grammar engine's view of the vocabulary (a second's work, on the
        grammar thread), so the first request with structured output does not wait for them."""
        from moeray.stages.text.grammar import in_background, ll_tokenizer

        if self.model is None or self.stage != self.n_stages - 1:
            return
        masks = self.runner._grammars(self.model.config.vocab_size)
        in_background(lambda: ll_tokenizer(masks.tokenizer, masks.n_vocab))

    def prepare_grammar(self, grammar: str) -> None:
        """The server saw a request with this grammar (response_format, a forced tool call): the
        last stage, which applies it, compiles it now on a thread of its own, beside its steps, so
        the request's first step finds it compiled (stages/text/grammar.py). Returns at once."""
        if self.model is None or self.stage != self.n_stages - 1:
            return
        from moeray.stages.text.grammar import in_background, matcher

        masks = self.runner._grammars(self.model.config.vocab_size)
        in_background(lambda: matcher(masks.tokenizer, grammar, masks.n_vocab))

    def record_routing(self, path: str) -> None:
        """Append every routing decision of this stage's expert cache to the trace file `path`
        (flushed whenever stats are polled), so served traffic can be replayed offline."""
        cache = self.model.experts if self.model is not None else None
        if not hasattr(cache, "trace_writer"):
            raise MoerayError(f"stage {self.stage}: no expert cache loaded, nothing to record")
        if cache.trace_writer is not None:
            cache.trace_writer.close()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        cache.trace_writer = routing_trace(path, self.model.config, self.model.first, self.model.end)

    def stats(self) -> StageStats:
        """This stage's live numbers: layers, device bytes, steps, time in steps (incl. waiting for
        the previous stage's activations), and its expert cache's lookups and hits when it has one."""
        out = StageStats(self.stage, self.device.name, self.device.node_ip, placed=dict(self.memory.parts),
                         free_bytes=self.memory.free, pid=os.getpid(), node_id=self.device.node_id)
        out.options = self.options()
        if self.model is not None:
            out.parts_opened = self.model.gguf.opened
        if self.model is not None:
            out.layers, out.steps, out.step_s, out.tokens_in = ((self.model.first, self.model.end), self.steps,
                                                                 self.step_s, self.tokens_in)
            out.backend, (out.trunk_held_bytes, out.trunk_gguf_bytes) = self.model.backend, self.trunk_bytes
            cache = getattr(self.model.experts, "stats", None)
            if callable(cache):
                out.cache = cache()
            out.kv = kv_stats(self.runner.kv)
            out.timings = list(self.timings)
        return out

    # ---------------------------------------------------------------- transport micro-benchmarks

    def link_check(self, rows: int, hidden: int, reps: int) -> dict[str, Any]:
        """Pass a known [rows, hidden] float32 tensor down the pipeline `reps` times over the process
        group (every stage calls this at once). The last stage checks every copy arrived intact and
        reports the mean ms per pass: the transport cost of one step with this activation size."""
        # On the stage's own device, as activations are: the pass costs what a step's hop costs
        # (on CUDA incl. the copies to and from the host when the group runs gloo).
        dev = self.link.compute_device
        expected = torch.arange(rows * hidden, dtype=torch.float32, device=dev).reshape(rows, hidden)
        intact = True
        t = time.perf_counter()
        for _ in range(reps):
            x = expected if self.link.is_first else self.link.recv(rows, hidden)
            if not self.link.is_last:
                self.link.send(x)
            else:
                intact = intact and bool(torch.equal(x, expected))  # .item() inside: waits for the copy
        return {"stage": self.stage, "ms_per_pass": (time.perf_counter() - t) * 1e3 / reps, "intact": intact,
                "backend": self.link.backend, "device": str(dev)}

    def relay(self, x, rest: list | None = None):
        """Ray-call chaining, for comparison: each stage hands x on by calling the next one."""
        import ray  # only here and in node_ip: see the note after the imports

        if not rest:
            return x
        return ray.get(rest[0].relay.remote(x, rest[1:]), timeout=30)
