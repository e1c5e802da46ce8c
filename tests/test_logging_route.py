"""fedlightning._logging_route: a module's self.log / self.log_dict routed for a block, then exactly restored."""

import pytest

from fedlightning._logging_route import discard, route_logging, routed_logging
from fedlightning.models import LogisticRegression


class Sink:
    def __init__(self):
        self.calls = []

    def log(self, name, value, **kwargs):
        self.calls.append((name, value))

    def log_dict(self, values, **kwargs):
        self.calls.extend(values.items())


def test_block_routes_both_methods_and_restores_the_class_methods():
    model, sink = LogisticRegression(input_dim=3, num_classes=2), Sink()
    assert "log" not in vars(model)
    with routed_logging(model, sink.log, sink.log_dict) as routed:
        assert routed is model
        model.log("a", 1.0)
        model.log_dict({"b": 2.0})
    assert sink.calls == [("a", 1.0), ("b", 2.0)]
    assert "log" not in vars(model) and "log_dict" not in vars(model)
    assert model.log.__func__ is type(model).log  # Lightning's own method again


def test_nested_routing_restores_the_outer_routing_also_after_an_exception():
    model, outer = LogisticRegression(input_dim=3, num_classes=2), Sink()
    route_logging(model, outer.log, outer.log_dict)
    with pytest.raises(KeyError):
        with routed_logging(model, discard, discard):
            model.log("dropped", 0.0)
            raise KeyError("inside")
    model.log("kept", 1.0)
    assert outer.calls == [("kept", 1.0)]
    with routed_logging(model, None, None):  # the class's methods inside, the routing back after
        assert "log" not in vars(model)
    assert vars(model)["log"] == outer.log and vars(model)["log_dict"] == outer.log_dict
