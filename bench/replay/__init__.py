"""`python -m bench.replay`: the command line of the open-loop replay. The library it drives
(trace reading, schedules, the runner, summaries) is `blitzmesh.replay`."""
