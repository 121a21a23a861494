"""What the worker pools (polar_fast/pools.py) run, and the rollout side of a run:

    tasks.py      task rows (SWE-bench schema) and the task repo inside a sandbox
    sandboxes/    where harnesses and tests run: docker (aiodocker) or local (a temp dir)
    harnesses/    one adapter per coding-agent CLI: install, config files, command line
    agent.py      the agent stage: a proxy session per rollout, the harness pointed at it
    reward.py     the eval stage: apply the test patch, run the tests, parse the reward
    stack.py      engine + proxy + sandbox factory + agent, set up and torn down together
    service.py    the rollout-service HTTP API for external trainers
"""
