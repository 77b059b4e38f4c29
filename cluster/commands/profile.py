"""`moeray profile`: routing profiles from routing traces, and what a profile says.

  moeray profile make TRACE... -o profile.msgpack   count every (layer, expert) routing decision
                                                    of the traces; rank the pairs hottest first
  moeray profile show PROFILE [--plot heat.png]     per-layer heat and the mass curve it implies

Torch-free: traces are msgpack and the planner is numpy.
"""
from __future__ import annotations

import sys

import numpy as np

from moeray.planner.mass import H, mass_model
from moeray.planner.profile import Profile
from moeray.errors import MoerayError, ProfileError

CURVE_FRACTIONS = (0.01, 0.05, 0.1, 0.2, 0.25, 0.5, 0.75, 1.0)


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="profile_command", metavar="ACTION")
    make = sub.add_parser("make", help="build a profile with counts from routing traces")
    make.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (moeray generate --record-routing)")
    make.add_argument("-o", "--output", required=True, help="profile to write (moeray msgpack)")
    rec = sub.add_parser("record", help="a profile from what a running `moeray serve` has routed so far")
    rec.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    rec.add_argument("--api-key", default=None, help="the server's API key (default: $MOERAY_API_KEY)")
    rec.add_argument("-o", "--output", required=True, help="profile to write (moeray msgpack)")
    show = sub.add_parser("show", help="per-layer heat and the mass curve of a profile")
    show.add_argument("profile", help="moeray msgpack, Strata STRP or colibri heat file")
    show.add_argument("--top", type=int, default=4, help="hottest experts to list per layer")
    show.add_argument("--plot", metavar="PNG", help="draw the heat map and mass curve (needs matplotlib)")


def run(args) -> int:
    if args.profile_command == "make":
        return make(args.traces, args.output)
    if args.profile_command == "record":
        return record(args.url, args.output, args.api_key)
    if args.profile_command == "show":
        prof = Profile.load(args.profile)
        for line in describe(prof, top=args.top):
            print(line)
        if args.plot:
            plot_profile(prof, args.plot)
            print(f"wrote {args.plot}")
        return 0
    raise ProfileError("moeray profile: choose an action: make, record or show")


def profile_from_traces(paths) -> tuple[Profile, "object"]:
    from moeray.cache.trace import read_trace

    trace = read_trace(paths)
    try:
        trace.check_whole()
    except MoerayError as exc:
        raise ProfileError(str(exc)) from None
    counts = trace.counts()
    if counts.sum() == 0:
        raise ProfileError(f"{', '.join(map(str, paths))}: the traces hold no routing decisions")
    return Profile.from_counts(counts), trace


def make(paths, output) -> int:
    prof, trace = profile_from_traces(paths)
    h = trace.header
    seen = int(np.count_nonzero(prof.counts))
    note = f", {trace.truncated_bytes} trailing bytes of a cut record ignored" if trace.truncated_bytes else ""
    prof.save(output)
    print(f"{len(trace.paths)} trace(s): {len(trace.records)} records, {trace.n_tokens} tokens, "
          f"layers [{h.first}, {h.end}) of {h.n_layers}, top-{h.k} of {h.n_experts}{note}")
    print(f"wrote {output}: {len(prof.pairs)} pairs ranked, {seen} seen, {sum(prof.counts)} routed lookups")
    return 0


def mass_curve(prof: Profile, b: float) -> list[tuple[int, float, float | None]]:
    """(held pairs n, H(n/T) with exponent b, measured share of the hottest n or None) at CURVE_FRACTIONS."""
    T = len(prof.pairs)
    cum = None
    if prof.counts is not None and sum(prof.counts) > 0:
        cum = np.cumsum(np.asarray(prof.counts, dtype=np.float64)) / float(sum(prof.counts))
    out, done = [], set()
    for f in CURVE_FRACTIONS:
        n = max(1, int(round(f * T)))
        if n in done:
            continue
        done.add(n)
        out.append((n, float(H(n / T, b)), None if cum is None else float(cum[n - 1])))
    return out


def describe(prof: Profile, top: int = 4) -> list[str]:
    L, E, T = prof.n_layers, prof.n_experts, len(prof.pairs)
    table = prof.count_table()
    lines = []
    if table is not None:
        total = int(table.sum())
        lines.append(f"profile: {L} layers x {E} experts, {total} routed lookups "
                     f"({int(np.count_nonzero(table))} of {T} pairs seen)")
        lines.append(f"{'layer':>5} {'lookups':>8}  hottest experts (share of the layer)"
                     f"{'':<{max(0, 11 * top - 36)}}  experts for 50% / 90%")
        for l in range(L):
            row = table[l]
            n = int(row.sum())
            order = np.argsort(-row, kind="stable")
            share = row[order] / n if n else np.zeros(E)
            hot = " ".join(f"{int(e)}:{100 * s:5.1f}%" for e, s in zip(order[:top], share[:top]))
            cum = np.cumsum(share)
            k50 = int(np.searchsorted(cum, 0.5 - 1e-12) + 1) if n else 0
            k90 = int(np.searchsorted(cum, 0.9 - 1e-12) + 1) if n else 0
            lines.append(f"{l:>5} {n:>8}  {hot:<{11 * top}}  {k50} / {k90}")
    else:
        rank = {p: r for r, p in enumerate(prof.pairs)}
        lines.append(f"profile: {L} layers x {E} experts, ranking only (no counts)")
        lines.append(f"{'layer':>5}  hottest experts (global rank)")
        for l in range(L):
            experts = sorted(range(E), key=lambda e: rank[(l, e)])[:top]
            lines.append(f"{l:>5}  " + " ".join(f"{e}:#{rank[(l, e)]}" for e in experts))
    mm = mass_model(prof, "curve")
    b = mm.b
    lines.append(mm.line())
    lines.append(f"mass curve: share of the routed mass held by the hottest n of {T} pairs")
    lines.append(f"{'n':>8} {'fraction':>9} {'H(f) b=' + format(b, '.2f'):>10} {'measured':>9}")
    for n, h, m in mass_curve(prof, b):
        lines.append(f"{n:>8} {100 * n / T:>8.1f}% {100 * h:>9.1f}% "
                     f"{'-' if m is None else format(100 * m, '.1f') + '%':>9}")
    return lines


def plot_profile(prof: Profile, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ProfileError("--plot needs matplotlib: pip install 'moeray[plot]'") from None
    L, E, T = prof.n_layers, prof.n_experts, len(prof.pairs)
    table = prof.count_table()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    if table is not None:
        share = table / np.maximum(table.sum(axis=1, keepdims=True), 1)
        im = ax0.imshow(share.T, aspect="auto", origin="lower", cmap="magma")
        fig.colorbar(im, ax=ax0, label="share of the layer's lookups")
        ax0.set_title("per-layer heat")
    else:
        ranks = np.zeros((L, E))
        for r, (l, e) in enumerate(prof.pairs):
            ranks[l, e] = r
        im = ax0.imshow(ranks.T, aspect="auto", origin="lower", cmap="magma_r")
        fig.colorbar(im, ax=ax0, label="global rank (0 = hottest)")
        ax0.set_title("per-layer rank")
    ax0.set_xlabel("layer")
    ax0.set_ylabel("expert")
    f = np.arange(T + 1) / T
    b = mass_model(prof, "curve").b
    ax1.plot(100 * f, 100 * H(f, b), label=f"H(f) = 1-(1-f)^{b:.2f}", color="#888")
    if prof.counts is not None and sum(prof.counts) > 0:
        cum = np.concatenate([[0.0], np.cumsum(prof.counts) / float(sum(prof.counts))])
        ax1.plot(100 * f, 100 * cum, label="measured (counts)", color="#c33")
    ax1.set_xlabel("hottest pairs held (% of all)")
    ax1.set_ylabel("routed mass held (%)")
    ax1.set_title("mass curve")
    ax1.legend()
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="moeray profile")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))


def record(url: str, output, api_key: str | None = None) -> int:
    """GET /v1/admin/profile: the picks every stage has counted since it started, as a profile with
    counts. Serve -> record -> `moeray serve --profile` (or `moeray plan --profile`) re-plans with
    the traffic really served."""
    import json
    import urllib.error
    import urllib.request

    from moeray import environment

    key = api_key or environment.api_key()
    req = urllib.request.Request(url.rstrip("/") + "/v1/admin/profile",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
    except urllib.error.HTTPError as exc:
        try:
            why = json.loads(exc.read())["error"]["message"]
        except Exception:  # noqa: BLE001 - not the server's JSON error: say the status
            why = exc.reason
        raise ProfileError(f"{url}: HTTP {exc.code}: {why}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ProfileError(f"{url}: cannot reach the server ({exc})") from None
    prof = _profile_from_bytes(data, url)
    prof.save(output)
    print(f"wrote {output}: {int(sum(prof.counts))} routed picks over {prof.n_layers} layers x {prof.n_experts} experts")
    return 0


def _profile_from_bytes(data: bytes, where: str) -> Profile:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".msgpack") as f:
        f.write(data)
        f.flush()
        try:
            return Profile.load(f.name)
        except ProfileError as exc:
            raise ProfileError(f"{where} sent no moeray profile: {exc}") from None
