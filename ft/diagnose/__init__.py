"""`ft diagnose`: run a target under the probes, summarise the samples, apply the findings rules."""
