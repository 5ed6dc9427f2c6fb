"""Simulation of the scheduler on a virtual clock: workloads, baselines, metrics, pictures.

The simulator drives any object with the policy API of SPEC §1 and writes an event log
whose schema is in `uniun_ray.events.schema` (the bottom layer, beside the policy); metrics and pictures read only that log, so a
real run's JSONL log is scored and drawn by the same code.

Entry points: `simulator.simulate(policy, workload, device, devices, slots)`, `workloads.generate(name,
seed)`, `metrics.measure(events)`, `plots.timeline(Trace(events), path)`, `bench.main(argv)`;
`uniun_ray.replay.play(workload)` (above the client: it needs Ray) plays a workload on the
real runtime for the same scores. Nothing here imports Ray or torch.
"""
