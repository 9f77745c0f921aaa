"""`tandem plan`: know when to split. `profile` measures the costs a plan is made of on the
machine at hand (the simulator, validation, search and projection build on its document)."""
