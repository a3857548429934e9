"""Analysis: routing traces (trace), the expert-slot simulator (simulate) and memory sizing (sizing)."""
