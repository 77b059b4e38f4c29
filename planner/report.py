"""A plan as a picture: per stage, layers, trunk bytes, cache bytes and held mass (matplotlib optional)."""
from __future__ import annotations

from moeray.errors import MoerayError

GIB = 1 << 30


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
