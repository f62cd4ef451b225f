"""bench.slo: SLO attainment and goodput of FCFS, MAX_UTILIZATION and SCORPIO on one worker."""
