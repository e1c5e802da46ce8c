"""Users' code written for plain Lightning, which the configs of configs/examples/ federate."""
