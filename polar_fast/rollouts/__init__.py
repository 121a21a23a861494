"""What the worker pools (polar_fast/pools.py) run, and the rollout side of a run:

    task_rows.py  a task row (SWE-bench schema) as a Task; tasks.py loads task sources, puts the
                  task repo inside a sandbox; families.py generates tasks
    groups.py     a group to run (GroupSpec) and a finished group's one record (GroupRecord)
    sandboxes/    where harnesses and tests run: docker (aiodocker) or local (a temp dir)
    harnesses/    one adapter per coding-agent CLI: install, config files, command line
    agent.py      the agent stage: a proxy session per rollout, the harness pointed at it
    reward.py     the eval stage: apply the test patch, run the tests, parse the reward
    stack.py      engine + proxy + sandbox factory + agent, set up and torn down together
    service.py    the rollout-service HTTP API for external trainers (serve.py runs it)

Nothing here imports the pools (pools.py): the layers only point down (tests/test_layout.py).
"""
