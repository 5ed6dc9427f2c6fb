"""Simulation of the scheduler on a virtual clock: workloads, baselines, metrics, pictures.

The simulator drives any object with the policy API of SPEC §1 and writes an event log
whose schema is in `uniun_ray.sim.events`; metrics and pictures read only that log, so a
real run's JSONL log is scored and drawn by the same code.

Entry points: `simulator.simulate(policy, workload, device)`, `workloads.generate(name,
seed)`, `metrics.measure(events)`, `plots.timeline(Trace(events), path)`, `bench.main(argv)`;
`replay.play(workload)` plays a workload on the real runtime for the same scores.
"""
