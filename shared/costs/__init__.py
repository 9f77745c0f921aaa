"""What serving costs on some hardware: the profile document `tandem plan profile|project`
writes (profile.py) and the cost model that reads times off it (model.py), used by the
planner's simulator and by the router's per-request choice of prefill path."""
