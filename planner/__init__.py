"""The placement planner: pure functions of sizes, speeds and a routing profile (numpy only; never torch or Ray).

profile  routing profiles (moeray msgpack, Strata STRP, colibri heat) ranked hottest first
mass     the share of routed traffic a ranked pair carries (H curve or measured counts)
spec     ModelSpec: layers, experts, k, expert and trunk bytes
devices  DeviceSpec: free bytes, ms per dense layer, ms per missed expert
fill     a stage's cache fill with the stop rule, and RangeTables to answer thousands at once
trunk    which dense pieces go on each card (value per byte of VRAM), priced inside every range
search   the layer split: enumeration (S <= 4) and an exact DP (any S), latency or throughput
slots    per-layer expert slots (one quota per layer at its own blob size)
report   the plan as text (short, --verbose) and --plot
"""
