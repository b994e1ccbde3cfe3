"""Hub replicas each have a broker user; every replica writes all of them into Mosquitto's files."""

from __future__ import annotations

from pathlib import Path

from cloud_hub.broker_auth import BrokerAccount, mosquitto_hash, verify_mosquitto_hash, write_broker_files


def test_peer_hub_users_get_full_access_and_endpoints_stay_confined(tmp_path: Path) -> None:
    acct = BrokerAccount("ep-1", mosquitto_hash("devpw"), "ep-1")
    peer_hash = mosquitto_hash("peerpw")
    pw, acl = write_broker_files(tmp_path, "hub-a", "apw", "mesh", [acct], [("hub-b", peer_hash)])
    users = dict(line.split(":", 1) for line in pw.read_text().splitlines())
    assert set(users) == {"hub-a", "ep-1", "hub-b"}
    assert verify_mosquitto_hash("apw", users["hub-a"]) and users["hub-b"] == peer_hash
    blocks = {b.split("\n")[0]: b for b in ("\n" + acl.read_text()).split("\nuser ")[1:]}
    assert "topic readwrite #" in blocks["hub-a"] and "topic readwrite #" in blocks["hub-b"]
    assert "topic read mesh/ep/ep-1/down" in blocks["ep-1"] and "#" not in blocks["ep-1"].replace("# ", "")
