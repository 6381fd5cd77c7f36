"""One model over several processes or hosts: tensor and pipeline parallel.

vLLM is the control plane (its executor starts one worker per rank, on one
host or across hosts with --nnodes/--node-rank/--master-addr/--headless);
MLX's distributed group is the data plane, inside each step's graph.

- topology.py: ranks, stages, the layer split
- ring.py: the start-up exchange and the MLX group (ring / JACCL)
- join.py: what a worker does to take its place (gloo group, exchange, plan)
- pipeline.py: stages (layer pass-throughs, send/recv between neighbours)
- tensor_parallel.py: mlx-lm's shard() and the row-parallel sum
- plan.py: this rank's share (ParallelPlan), as the model loader takes it
"""
