"""Choosing a layout before launch: the cluster it is for (`cluster`), a step-time
model to rank layouts by (`throughput`), and the search over layouts that fit (`search`)."""
