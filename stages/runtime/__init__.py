"""One stage at run time: the stage model and its stage graph, the step's contract (step.py), the
stage's compute (runner.py) and the actor around it, transport between stages, the device (real
or a byte budget), and the default model's routing profile."""
