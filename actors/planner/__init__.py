"""The SLA planner: scales prefill, decode and agg pools through the supervisors so that TTFT and
ITL targets hold with as few engines as possible (``actors.planner.actor.PlannerActor``)."""
