"""One stage at run time: the stage model and its stage graph, the actor, transport between
stages, the device (real or a byte budget), and the default model's routing profile."""
