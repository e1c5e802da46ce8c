"""Code as a user writes it for plain Lightning, standing for your own package: configs of configs/examples/ federate
it unchanged."""
