"""The Ray side of a job: connect to a cluster, place ranks, run the controller and workers."""
