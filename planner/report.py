"""A plan for people: the short text every command prints, the per-layer detail (--verbose), and
a picture (--plot, matplotlib optional).

The short form is one line per stage (device, layers, trunk, slots, predicted hit rate, predicted
ms) and one line per decision that departs from the default: a trunk piece left off the card
(consecutive layers with the same verdict share a line) and a stage whose slots are not the
per-layer quota. A 94-layer model prints a handful of lines before its URL, not a hundred.
"""
from __future__ import annotations

from moeray.errors import MoerayError
from moeray.units import format_bytes

GIB = 1 << 30


def plan_lines(plan, verbose: bool = False) -> list[str]:
    """The plan's text: the short form, or with `verbose` every trunk decision and slot layout."""
    body = _detail_lines(plan) if verbose else _stage_table(plan) + _departures(plan)
    tail = [plan.mass.line()] if plan.mass is not None else []
    tail += [plan.kv.line()] if plan.kv is not None else []
    return [plan.startup_line()] + body + tail + list(plan.notes)


def _device_name(s) -> str:
    # The driver names a device "stage i <card>"; the line already says which stage it is.
    prefix = f"stage {s.index} "
    return s.device[len(prefix):] if s.device.startswith(prefix) else s.device


def _slots_text(s) -> str:
    if s.slots is None:
        return "no expert slots"
    if s.slots.per_layer:
        return f"{s.slots.n_slots} slots ({s.slots.quota} per layer)"
    return f"{s.slots.n_slots} uniform slots"


def _trunk_text(s, trunk_mode: str) -> str:
    if trunk_mode == "off":
        return "trunk not placed"
    off = sum(d["bytes"] for d in s.trunk if not d["on_card"])
    return f"trunk {format_bytes(s.trunk_bytes)}" + (f" (+{format_bytes(off)} on the host)" if off else "")


def _stage_table(plan) -> list[str]:
    """One line per stage, its fields in aligned columns so the stages read as a table."""
    rows = [[f"stage {s.index}", _device_name(s), f"layers {s.first_layer}-{s.end_layer - 1}",
             _trunk_text(s, plan.trunk_mode), _slots_text(s),
             f"predicted hit rate {100 * s.predicted_hit_rate:.1f}%", f"{s.stage_ms:.2f} ms"] for s in plan.stages]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))] if rows else []
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _departures(plan) -> list[str]:
    """One line per decision that is not the default: trunk pieces off the card, slots that are
    not the per-layer quota (one copy of every layer did not fit, or no room for one expert)."""
    out = []
    for s in plan.stages:
        for run in _runs_off_card(s.trunk):
            first = run[0]
            if len(run) == 1:
                what, why = f"{first['component']} ({format_bytes(first['bytes'])})", first["why"]
            else:
                total = sum(d["bytes"] for d in run)
                what = f"layers {run[0]['layer']}-{run[-1]['layer']} trunks ({format_bytes(total)})"
                why = f"layer {first['layer']}: {first['why']}"
            out.append(f"[place] stage {s.index}: {what} -> cpu: {why}")
        if s.slots is None:
            out.append(f"[slots] stage {s.index}: no room for one expert ({format_bytes(s.expert_room)} after the "
                       "trunk): every routed expert is computed on the host")
        elif not s.slots.per_layer:
            out.append(f"[slots] stage {s.index}: {s.slots.message}")
    return out


def _runs_off_card(decisions) -> list[list[dict]]:
    """The off-card decisions, consecutive layer trunks merged into runs."""
    runs: list[list[dict]] = []
    for d in decisions:
        if d["on_card"]:
            continue
        prev = runs[-1][-1] if runs else None
        if (prev is not None and d["layer"] >= 0 and prev["layer"] >= 0 and d["layer"] == prev["layer"] + 1):
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def _detail_lines(plan) -> list[str]:
    """Every stage, every trunk decision with the numbers behind it, every slot layout."""
    out = []
    for s in plan.stages:
        out.append(f"stage {s.index} ({s.device}): layers {s.first_layer}-{s.end_layer - 1}, "
                   f"{s.stage_ms:.2f} ms, trunk {format_bytes(s.trunk_bytes)}, expert room "
                   f"{format_bytes(s.expert_room)} holds {len(s.held_pairs)} pairs "
                   f"({100 * s.held_mass / max(s.routed_mass, 1e-300):.1f}% of its routed mass)")
        for d in s.trunk:
            out.append(f"[place] stage {s.index}: {d['component']} ({format_bytes(d['bytes'])}) -> "
                       f"{'gpu' if d['on_card'] else 'cpu'}: {d['why']}; expert room "
                       f"{format_bytes(d['expert_room_after'])}")
        if s.slots is not None:
            out.append(f"[slots] stage {s.index}: {s.slots.message}; they hold {s.slot_pairs} pairs: "
                       f"predicted hit rate {100 * s.predicted_hit_rate:.1f}%")
    return out


def state_line(per_seq: list[int], split, n_seqs: int) -> str:
    """[state] what the recurrent state costs each stage: priced per sequence, as KV is."""
    n = sum(1 for b in per_seq if b)
    stages = ", ".join(format_bytes(n_seqs * sum(per_seq[a:b])) for a, b in split)
    return (f"[state] {n} recurrent layers hold {format_bytes(sum(per_seq))} of state per sequence; "
            f"{n_seqs} sequence(s) (--max-seqs) charged to their layers' cards: {stages}")


def checkpoint_line(per_seq: list[int], split, n: int, block_bytes: int, rule: str, tried=()) -> str:
    """[state] the recurrent-state checkpoints each stage holds, and their price in KV blocks."""
    each = sum(per_seq)
    stages = ", ".join(format_bytes(n * sum(per_seq[a:b])) for a, b in split)
    blocks = f" (the bytes of {each / block_bytes:.0f} KV blocks)" if block_bytes else ""
    out = (f"[state] {n} checkpoint(s) of the recurrent state, {format_bytes(each)} each{blocks}, charged to "
           f"their layers' cards: {stages}; {rule}")
    if tried:
        out += "; tried " + ", ".join(f"{c}: {'no fit' if ms is None else f'{ms:.1f} ms'}" for c, ms in tried)
    return out


def plot_plan(plan, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoerayError("--plot needs matplotlib: pip install 'moeray[plot]'") from None
    st = plan.stages
    names = [f"{s.index}: {s.device}\nL{s.first_layer}-{s.end_layer - 1}" for s in st]
    x = range(len(st))
    fig, axes = plt.subplots(1, 3, figsize=(4 + 2.2 * len(st), 3.8))
    axes[0].bar(x, [s.n_layers for s in st], color="#777")
    axes[0].set_title("layers")
    axes[1].bar(x, [s.trunk_bytes / GIB for s in st], label="trunk", color="#c84")
    axes[1].bar(x, [s.held_bytes / GIB for s in st], bottom=[s.trunk_bytes / GIB for s in st],
                label="expert cache", color="#48c")
    axes[1].plot(x, [s.free_bytes / GIB for s in st], "k_", markersize=30, label="free")
    axes[1].set_title("VRAM (GiB)")
    axes[1].legend(fontsize=7)
    axes[2].bar(x, [100 * s.held_mass / max(s.routed_mass, 1e-300) for s in st], color="#4a4")
    axes[2].set_ylim(0, 100)
    axes[2].set_title("held share of routed mass (%)")
    for ax in axes:
        ax.set_xticks(list(x), names, fontsize=7)
    fig.suptitle(f"K={','.join(map(str, plan.boundaries)) or '-'}: predicted {plan.predicted_ms:.1f} ms/step "
                 f"({plan.objective}, {plan.placements_scored} placements)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
