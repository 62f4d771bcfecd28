import pytest

from reach._subjects import (
    Subjects,
    validate_agent_id,
    validate_capability,
    validate_topic,
)


@pytest.mark.parametrize("name", ["text.translate", "a", "order-status.v2_x", "a.b.c.d", "x" * 128])
def test_valid_capabilities(name):
    assert validate_capability(name) == name


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("text.*", "wildcard"),
        ("text.>", "wildcard"),
        ("text translate", "a space"),
        ("text..translate", "empty token"),
        (".text", "empty token"),
        ("text.", "empty token"),
        ("", "empty"),
        ("x" * 129, "at most 128"),
        ("Text.Translate", "lowercase"),
        ("text/translate", "'/'"),
        ("tëxt", "lowercase"),
    ],
)
def test_invalid_capabilities_say_why(name, reason):
    with pytest.raises(ValueError, match=reason):
        validate_capability(name)


def test_topic_wildcards_only_for_subscriptions():
    with pytest.raises(ValueError, match="wildcard"):
        validate_topic("order.*")
    assert validate_topic("order.*", wildcards=True) == "order.*"
    assert validate_topic("order.>", wildcards=True) == "order.>"
    with pytest.raises(ValueError, match="last token"):
        validate_topic("order.>.x", wildcards=True)


@pytest.mark.parametrize("agent_id", ["a", "logistics-1", "X_y-Z9"])
def test_valid_agent_ids(agent_id):
    assert validate_agent_id(agent_id) == agent_id


@pytest.mark.parametrize("agent_id", ["", "a.b", "a b", "a*", "$ping", "a" * 129])
def test_invalid_agent_ids(agent_id):
    with pytest.raises(ValueError, match="agent_id"):
        validate_agent_id(agent_id)


def test_subjects_follow_the_architecture():
    s = Subjects("reach")
    assert s.cap("text.translate") == "reach.cap.text.translate"
    assert s.cap_queue("text.translate") == "cap.text.translate"
    assert s.agent("a-1", "text.translate") == "reach.agent.a-1.text.translate"
    assert s.ping("a-1") == "reach.agent.a-1.$ping"
    assert s.ctl("a-1") == "reach.agent.a-1.$ctl"
    assert s.heartbeat("a-1") == "reach.hb.a-1"
    assert s.topic("order.status") == "reach.topic.order.status"
    assert s.topic_of("reach.topic.order.status") == "order.status"
    assert s.registry("list") == "reach.registry.list"
    assert s.register("a-1") == "reach.registry.register.a-1"
    assert s.deregister("a-1") == "reach.registry.deregister.a-1"
    assert s.register("*") == "reach.registry.register.*"
    assert s.event("a-1") == "reach.evt.agent.a-1"
    assert Subjects("tenant1.reach").cap("x") == "tenant1.reach.cap.x"
    with pytest.raises(ValueError, match="prefix"):
        Subjects("bad prefix")
