"""`tandem autoscale`: scale prefill and decode capacity on load, never dropping a request."""
