"""The device a stage runs on: what it is, how much memory it really has, how fast it is.

A stage actor calls `probe_device` before anything is loaded, so the planner works from the
card's real free memory, not from a label.

* CUDA: NVML is asked by **PCI bus id**, never by index. CUDA numbers devices fastest-first
  unless CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML numbers them by bus, and CUDA_VISIBLE_DEVICES
  renumbers them again; the bus id is the one name both agree on. torch.cuda.mem_get_info is
  the fallback when NVML is missing or refuses.
* A share of a card: two stages on one GPU (Ray's fractional GPUs, `--gpus-per-stage 0.5`)
  each see the whole card through NVML; each is given its share of what is free and of the
  total (`share_of_card`), so the two plans together never promise the card twice.
* Simulated: `--simulate-devices 12GiB,8GiB` gives a stage a CPU "device" with a byte budget.
  its byte ledger (`device_ledger`) enforces it, so a plan that overfills a simulated card fails the same
  way a real one would (earlier, and with a clearer message).

`measure_speed` times one real layer of the model, loaded on the device and run by the serving
code: the planner's `layer_ms` (one decode token through attention + router + the experts a token
uses, all resident) and `miss_ms` (one routed expert computed on the host from its quantised
bytes, which is what a cache miss costs).
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any


from moeray.errors import MoerayError
from moeray.units import format_bytes

# Kept free on a real card for the CUDA context's growth, activations and allocator slack.
CUDA_RESERVE_BYTES = 512 << 20


@dataclass
class DeviceInfo:
    kind: str  # "cuda" | "simulated"
    name: str
    total_bytes: int
    free_bytes: int
    torch_device: str  # what tensors are moved to: "cuda:0", "cpu"
    pci_bus_id: str = ""
    memory_source: str = ""  # "nvml" | "torch.cuda.mem_get_info" | "simulated budget"
    reserve_bytes: int = 0  # of free_bytes, kept back for scratch (0 on a simulated device)
    card_share: float = 1.0  # the part of the card this stage was given (total/free are already that part)
    node_id: str = ""
    node_ip: str = ""
    hostname: str = field(default_factory=socket.gethostname)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nvml_memory(pci_bus_id: str) -> tuple[str, int, int]:
    """(name, total, free) from NVML for the card at this PCI bus id. Raises pynvml.NVMLError."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
        name = pynvml.nvmlDeviceGetName(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return (name.decode() if isinstance(name, bytes) else str(name)), int(mem.total), int(mem.free)
    finally:
        pynvml.nvmlShutdown()


def cuda_pci_bus_id(ordinal: int) -> str:
    """NVML's spelling of a CUDA device's bus id: '00000000:65:00.0' (domain:bus:device.function, hex)."""
    import torch

    props = torch.cuda.get_device_properties(ordinal)
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, int):  # torch gives the domain, bus and device numbers separately
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"  # NVML's own spelling
    return str(bus)


def cuda_views(ordinal: int = 0) -> dict[str, Any]:
    """NVML's and torch's view of one CUDA card side by side (name, bus id, total, free), or the
    reason NVML gave none: what bench/device_check.py prints to show both agree on the card."""
    import torch

    bus_id = cuda_pci_bus_id(ordinal)
    free, total = torch.cuda.mem_get_info(ordinal)
    out: dict[str, Any] = {"torch": {"name": torch.cuda.get_device_name(ordinal), "pci_bus_id": bus_id,
                                     "total_bytes": int(total), "free_bytes": int(free)}}
    try:
        name, total, free = _nvml_memory(bus_id)
        out["nvml"] = {"name": name, "pci_bus_id": bus_id, "total_bytes": total, "free_bytes": free}
    except Exception as exc:  # noqa: BLE001 - reported, not raised: torch's view still stands
        out["nvml"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def probe_cuda(ordinal: int = 0) -> DeviceInfo:
    import torch

    bus_id = cuda_pci_bus_id(ordinal)
    try:
        name, total, free = _nvml_memory(bus_id)
        source = "nvml"
    except Exception as exc:  # pynvml missing, NVML driver library absent, or the bus id unknown to it
        free, total = torch.cuda.mem_get_info(ordinal)
        name = torch.cuda.get_device_name(ordinal)
        source = f"torch.cuda.mem_get_info (NVML: {type(exc).__name__}: {exc})"
    return DeviceInfo(kind="cuda", name=name, total_bytes=int(total), free_bytes=int(free),
                      torch_device=f"cuda:{ordinal}", pci_bus_id=bus_id, memory_source=source,
                      reserve_bytes=min(CUDA_RESERVE_BYTES, int(free)))


def share_of_card(info: DeviceInfo, share: float) -> DeviceInfo:
    """The card as one of the stages sharing it sees it: `share` of its total and of what is free
    now (what every stage process on it, this one included, has not taken yet). Each stage
    still keeps its own reserve: every process has its own CUDA context and scratch."""
    if share >= 1.0:
        return info
    free, total = int(info.free_bytes * share), int(info.total_bytes * share)
    return replace(info, total_bytes=total, free_bytes=free, card_share=share,
                   reserve_bytes=min(CUDA_RESERVE_BYTES, free))


def simulated_device(budget_bytes: int, index: int = 0) -> DeviceInfo:
    return DeviceInfo(kind="simulated", name=f"simulated device {index} ({format_bytes(budget_bytes)} on CPU)",
                      total_bytes=int(budget_bytes), free_bytes=int(budget_bytes), torch_device="cpu",
                      memory_source="simulated budget")


def probe_device(simulated_budget: int | None = None, index: int = 0, card_share: float = 1.0) -> DeviceInfo:
    """The device this process owns: the simulated one when a budget is given, else its CUDA card
    (`card_share` of it when stages share the card).

    Inside a Ray actor with num_gpus=1 (or a fraction), Ray sets CUDA_VISIBLE_DEVICES to the one
    card it granted, so that card is CUDA ordinal 0 here.
    """
    if simulated_budget is not None:
        info = simulated_device(simulated_budget, index)
    else:
        import torch

        if not torch.cuda.is_available():
            raise MoerayError("this stage was given no simulated budget and sees no CUDA device; "
                              "pass --simulate-devices SIZE,... to run on CPU")
        info = share_of_card(probe_cuda(0), card_share)
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            info.node_id = ctx.get_node_id()
            info.node_ip = ray.util.get_node_ip_address()
    except ImportError:
        pass
    return info


def host_threads_for_stage(card_share: float = 1.0, n_stages: int = 1) -> int | None:
    """Host threads for a CUDA stage's misses: its node's cores split among the stages it can hold
    (GPUs / share, at most the pipeline's stages), at least 1; None outside Ray (a plain process
    keeps torch's default)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        node = ray.get_runtime_context().get_node_id()
        res = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node and n["Alive"]), None)
    except Exception:  # noqa: BLE001 - threads are a speed matter, never a reason to fail a stage
        return None
    if not res or res.get("GPU", 0) <= 0:
        return None
    cores = res.get("CPU", 0) or os.cpu_count() or 1
    return stage_threads(cores, res["GPU"], card_share, n_stages)


def stage_threads(cores: float, gpus: float, card_share: float, n_stages: int) -> int:
    """cores / the stages a node holds: GPUs / share of them, but no more than the pipeline has
    (a small share caps memory, it does not bring more stages), at least 1 (pure: tested without Ray)."""
    stages = max(1.0, min(gpus / max(card_share, 1e-4), n_stages))
    return max(1, int(cores // stages))


def device_ledger(info: DeviceInfo, stage: int = 0):
    """The stage's byte ledger for its device: on a simulated device it IS the memory limit; on
    CUDA the allocator enforces the real one, and this ledger still fails first, with the
    component's name, instead of an OOM deep in a matmul."""
    from moeray.cache.budget import ByteBudget

    return ByteBudget(max(0, info.free_bytes - info.reserve_bytes), f"stage {stage} ({info.name})")


# ---------------------------------------------------------------- speed measurement


@dataclass
class SpeedReport:
    layer_ms: float  # one decode token through one layer: attention + router + the k experts it uses, resident
    miss_ms: float  # one routed expert for one token on the host, dequantised from its stored bytes
    context: int  # the cached positions the attention read while timing


def _median_ms(fn, reps: int, budget_s: float, sync) -> float:
    fn()  # warm-up: allocator, kernels, caches
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
        if time.perf_counter() > deadline:
            break
    return statistics.median(times)


def timed_layer(cfg, within: list[int] | None = None) -> int:
    """The layer a stage times: the middle MoE layer (the middle layer of a dense model), among
    `within` where only those layers' files are on this node (a model in parts)."""
    pool = cfg.moe_layers if cfg.is_moe else list(range(cfg.n_layers))
    if within is not None:
        pool = [l for l in pool if l in set(within)]
    return pool[len(pool) // 2]


def measure_layer_ms(gguf, device: str = "cpu", context: int = 256, reps: int = 50,
                     budget_s: float = 1.0, within: list[int] | None = None) -> float:
    """Median ms of one decode token through one real layer of this model (a middle one), run by
    the code that serves: its trunk loaded on `device`, attention reading `context` cached
    positions, and for an MoE layer every expert resident in a cache slot (hits; misses are
    `miss_ms`)."""
    import torch

    from moeray.stages.runtime.model import StageModel
    from moeray.stages.blocks.moe import HostExperts

    cfg = gguf.config
    layer = timed_layer(cfg, within)
    experts = None
    if cfg.is_moe:
        from moeray.cache.attach import build_cache

        experts = build_cache(HostExperts(gguf), layer, layer + 1, device, None, n_slots=cfg.n_experts)
    model = StageModel(gguf, layer, layer + 1, device, experts)
    kv = model.new_kv_cache(1, context + 1)
    x = torch.randn(1, cfg.hidden, generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        kv.lengths[0] = context  # the same cached context every time
        model.run_layers(x, model.batch_meta([1], [0], kv), kv)

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        return _median_ms(step, reps, budget_s, sync)


def measure_miss_ms(gguf, reps: int = 20, budget_s: float = 1.0, within: list[int] | None = None) -> float:
    """Median ms to compute one routed expert for one token on the host from its stored bytes
    (the host path a miss takes: HostExperts on the file mapping). 0.0 for a dense model."""
    import torch

    from moeray.stages.blocks.moe import HostExperts

    cfg = gguf.config
    if not cfg.is_moe:
        return 0.0
    host = HostExperts(gguf)
    layer = timed_layer(cfg, within)
    x = torch.randn(1, cfg.hidden, generator=torch.Generator().manual_seed(0))
    expert = iter(range(1 << 62))

    def miss():  # a different expert each time, as misses are: the mapping is read, not the CPU cache
        return host.weights(layer, next(expert) % cfg.n_experts)(x)

    with torch.inference_mode():
        return _median_ms(miss, reps, budget_s, lambda: None)


def measure_speed(gguf, device: str = "cpu", within: list[int] | None = None) -> SpeedReport:
    """layer_ms and miss_ms of a GGUFFile (a real layer is loaded and run: one of `within`, the
    layers whose parts this node holds, where not every part is here)."""
    ctx = 256
    return SpeedReport(layer_ms=measure_layer_ms(gguf, device, context=ctx, within=within),
                       miss_ms=measure_miss_ms(gguf, within=within), context=ctx)
