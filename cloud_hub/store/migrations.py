"""Schema migrations, applied in order at start-up; each runs in its own transaction.

Add a new ``(version, sql)`` pair at the end of ``_SOURCE``; never edit one that has shipped.
Statements are split on ``;``, so a comment must not contain one.

One text serves both stores (cloud_hub/store/sqlite.py and postgres.py). Where the two dialects
name a type differently, the text says so with a marker, and :func:`migrations_for` fills it in
from ``DIALECTS`` by plain string replacement (no parsing, no rewriting of what is around it):

* ``{real}``: a float column. SQLite ``REAL``; PostgreSQL ``DOUBLE PRECISION`` (timestamps need
  the precision; PostgreSQL's ``REAL`` is 4 bytes).
* ``{blob}``: bytes. ``BLOB``; ``BYTEA``.
* ``{bigint}``: an integer column. ``INTEGER``; ``BIGINT`` (SQLite's integers are 8 bytes).
* ``{serial_pk}``: a key the database numbers. ``INTEGER PRIMARY KEY AUTOINCREMENT``;
  ``BIGSERIAL PRIMARY KEY``.
* ``{rowid}``: first thing inside every ``CREATE TABLE (``. Nothing in SQLite, which gives every
  table a ``rowid`` already; ``rowid BIGSERIAL,`` in PostgreSQL, where queries that order by it
  (``ORDER BY created, rowid``) need it spelled out.

A column type written out (``TEXT``) is the same on both. The filled SQLite text is byte for byte
what these migrations were before the markers, so databases made before them are unchanged.
A ``{`` that is not one of these markers (``DEFAULT '{}'``, a comment) is left as it is.
"""

#: marker -> what it stands for, per backend (``migrations_for``)
DIALECTS: dict[str, dict[str, str]] = {
    "sqlite": {"{real}": "REAL", "{blob}": "BLOB", "{bigint}": "INTEGER",
               "{serial_pk}": "INTEGER PRIMARY KEY AUTOINCREMENT", "{rowid}": ""},
    "postgres": {"{real}": "DOUBLE PRECISION", "{blob}": "BYTEA", "{bigint}": "BIGINT",
                 "{serial_pk}": "BIGSERIAL PRIMARY KEY", "{rowid}": "rowid BIGSERIAL, "},
}

_SOURCE: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE users ({rowid}id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, created {real} NOT NULL);
        CREATE TABLE api_tokens (
            {rowid}hash TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users(id), name TEXT, created {real} NOT NULL
        );
        CREATE TABLE enroll_tokens (
            {rowid}hash TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users(id),
            expires {real} NOT NULL, uses_left {bigint} NOT NULL, created {real} NOT NULL
        );
        CREATE TABLE endpoints (
            {rowid}id TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users(id), name TEXT NOT NULL,
            transport TEXT NOT NULL, key {blob} NOT NULL, created {real} NOT NULL,
            last_seen {real}, online {bigint} NOT NULL DEFAULT 0, info TEXT NOT NULL DEFAULT '{}'
        );
        CREATE TABLE functions ({rowid}id TEXT PRIMARY KEY, body {blob} NOT NULL, name TEXT, created {real} NOT NULL);
        CREATE TABLE function_owners (
            {rowid}function_id TEXT NOT NULL REFERENCES functions(id), user_id TEXT NOT NULL REFERENCES users(id),
            PRIMARY KEY (function_id, user_id)
        );
        CREATE TABLE tasks (
            {rowid}id TEXT PRIMARY KEY, user_id TEXT NOT NULL, endpoint_id TEXT NOT NULL REFERENCES endpoints(id),
            function_id TEXT NOT NULL REFERENCES functions(id), args {blob},
            state TEXT NOT NULL CHECK (state IN ('queued', 'leased', 'acked', 'done')),
            created {real} NOT NULL, expires {real}, timeout {real}, attempts {bigint} NOT NULL DEFAULT 0,
            leased_until {real}, dispatched {real}, acked {real}, done {real}
        );
        CREATE INDEX tasks_queue ON tasks (endpoint_id, state, created);
        CREATE INDEX tasks_lease ON tasks (state, leased_until);
        CREATE INDEX tasks_user ON tasks (user_id, state);
        CREATE TABLE results (
            {rowid}seq {serial_pk}, task_id TEXT NOT NULL UNIQUE, user_id TEXT NOT NULL,
            ok {bigint} NOT NULL, data {blob}, started {real}, finished {real}, received {real} NOT NULL, pid {bigint}
        );
        CREATE INDEX results_user ON results (user_id, seq);
        CREATE INDEX results_age ON results (received);
        """,
    ),
    (
        2,
        # Scheduler (cloud_hub/placement.py): learned profiles as one JSON document, and one row
        # per placement decision with predicted vs actual (GET /v1/scheduler/decisions).
        """
        CREATE TABLE scheduler_state (
            {rowid}id {bigint} PRIMARY KEY CHECK (id = 1), saved {real} NOT NULL, policy TEXT NOT NULL, state TEXT NOT NULL
        );
        CREATE TABLE scheduler_decisions (
            {rowid}seq {serial_pk}, task_id TEXT NOT NULL, user_id TEXT NOT NULL,
            function_id TEXT NOT NULL, endpoint_id TEXT NOT NULL, policy TEXT NOT NULL,
            placed_at {real} NOT NULL, predicted_s {real},
            state TEXT NOT NULL CHECK (state IN ('placed', 'done', 'moved')),
            completed_at {real}, actual_s {real}, runtime_s {real}, ok {bigint},
            detail TEXT NOT NULL
        );
        CREATE INDEX scheduler_decisions_user ON scheduler_decisions (user_id, seq);
        CREATE INDEX scheduler_decisions_task ON scheduler_decisions (task_id, state);
        CREATE INDEX scheduler_decisions_age ON scheduler_decisions (placed_at);
        """,
    ),
    (
        3,
        # FL runs (cloud_hub/store/fl.py, /v1/fl/runs): run metadata, one record per round, the
        # latest global-weights checkpoint.
        """
        CREATE TABLE fl_runs (
            {rowid}id TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users(id), name TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed', 'aborted')),
            error TEXT, strategy TEXT NOT NULL, mode TEXT NOT NULL, rounds_planned {bigint} NOT NULL,
            rounds_done {bigint} NOT NULL DEFAULT 0, clients TEXT NOT NULL, client_names TEXT NOT NULL,
            config TEXT NOT NULL, created {real} NOT NULL, updated {real} NOT NULL
        );
        CREATE INDEX fl_runs_user ON fl_runs (user_id, created);
        CREATE TABLE fl_rounds (
            {rowid}run_id TEXT NOT NULL REFERENCES fl_runs(id), round {bigint} NOT NULL, record TEXT NOT NULL,
            loss {real}, accuracy {real}, created {real} NOT NULL, PRIMARY KEY (run_id, round)
        );
        CREATE TABLE fl_checkpoints (
            {rowid}run_id TEXT PRIMARY KEY REFERENCES fl_runs(id), round {bigint} NOT NULL, weights {blob} NOT NULL,
            state TEXT NOT NULL, created {real} NOT NULL
        );
        """,
    ),
    (
        4,
        """
        -- Security of the task path (docs/security.md): per-endpoint broker login (Mosquitto $7$ hash,
        -- never the password), the endpoint's ZeroMQ CURVE public key (z85), an optional allow-list
        -- of function ids (a JSON array, NULL for any), revocation time, endpoint sharing, hub key material.
        ALTER TABLE endpoints ADD COLUMN mqtt_user TEXT;
        ALTER TABLE endpoints ADD COLUMN mqtt_hash TEXT;
        ALTER TABLE endpoints ADD COLUMN curve_key TEXT;
        ALTER TABLE endpoints ADD COLUMN allowed_functions TEXT;
        ALTER TABLE endpoints ADD COLUMN revoked {real};
        CREATE UNIQUE INDEX endpoints_curve_key ON endpoints (curve_key) WHERE curve_key IS NOT NULL;
        CREATE TABLE endpoint_shares (
            {rowid}endpoint_id TEXT NOT NULL REFERENCES endpoints(id), user_id TEXT NOT NULL REFERENCES users(id),
            created {real} NOT NULL, PRIMARY KEY (endpoint_id, user_id)
        );
        CREATE INDEX endpoint_shares_user ON endpoint_shares (user_id);
        CREATE TABLE hub_secrets ({rowid}name TEXT PRIMARY KEY, value TEXT NOT NULL, created {real} NOT NULL);
        """,
    ),
    (
        5,
        # Hub replicas sharing one database (cloud_hub/store/postgres.py): which replica holds each
        # endpoint's session, until when. The owner renews it while the agent talks to it.
        """
        CREATE TABLE endpoint_owners ({rowid}endpoint_id TEXT PRIMARY KEY, replica TEXT NOT NULL, until {real} NOT NULL);
        """,
    ),
    (
        6,
        """
        -- Endpoint online/offline transitions, written by the dispatcher (console availability timeline).
        CREATE TABLE endpoint_events (
            {rowid}seq {serial_pk}, endpoint_id TEXT NOT NULL REFERENCES endpoints(id),
            online {bigint} NOT NULL, at {real} NOT NULL
        );
        CREATE INDEX endpoint_events_at ON endpoint_events (endpoint_id, at);
        -- Web console sign-ins: only the SHA-256 of the opaque session id is stored.
        CREATE TABLE console_sessions (
            {rowid}hash TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users(id), token_hash TEXT NOT NULL,
            created {real} NOT NULL, expires {real} NOT NULL, last_used {real} NOT NULL
        );
        CREATE INDEX console_sessions_expires ON console_sessions (expires);
        """,
    ),
    (
        7,
        """
        -- Idempotent submission: a client-generated key per task or batch. A retry with the same key
        -- (after a timeout, a dropped link, a hub crash mid-request) gets the tasks made the first
        -- time instead of new ones. request_hash tells a retry from a different request reusing a key.
        CREATE TABLE submit_keys (
            {rowid}user_id TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL,
            task_ids TEXT NOT NULL, endpoint_ids TEXT NOT NULL, created {real} NOT NULL,
            PRIMARY KEY (user_id, key)
        );
        CREATE INDEX submit_keys_created ON submit_keys (created);
        """,
    ),
    (
        8,
        """
        -- Task groups (SDK Executor.task_group_id / reload_tasks): a new process lists the tasks an
        -- earlier one filed under a group and re-attaches futures to them.
        ALTER TABLE tasks ADD COLUMN task_group_id TEXT;
        CREATE INDEX tasks_group ON tasks (user_id, task_group_id) WHERE task_group_id IS NOT NULL;
        """,
    ),
    (
        9,
        """
        -- Site gateways (docs/sites.md): the gateway endpoint that serves a device on its LAN, and
        -- for a task leased ahead of time to a site, the gateway holding it (its lease then lasts
        -- site_hold_s and survives the device's and the gateway's sessions ending).
        ALTER TABLE endpoints ADD COLUMN gateway_id TEXT;
        ALTER TABLE tasks ADD COLUMN site TEXT;
        """,
    ),
    (
        10,
        """
        -- Fair dispatch (cloud_hub/admission.py): a shared endpoint's queue is read per (user,
        -- function) flow, oldest first within each, so the hub can take turns between users.
        CREATE INDEX tasks_flow ON tasks (endpoint_id, state, user_id, function_id, created);
        -- Memoization (mesh_agent/protocol/memo.py, docs/sdk.md): the client's cache key of a task submitted with
        -- cache=True. A successful result of such a task answers later submits with the same key.
        ALTER TABLE tasks ADD COLUMN memo_key TEXT;
        CREATE TABLE memo (
            {rowid}user_id TEXT NOT NULL, key TEXT NOT NULL, task_id TEXT NOT NULL, function_id TEXT NOT NULL,
            created {real} NOT NULL, expires {real} NOT NULL, last_hit {real}, hits {bigint} NOT NULL DEFAULT 0,
            size {bigint} NOT NULL, PRIMARY KEY (user_id, key)
        );
        CREATE INDEX memo_expires ON memo (expires);
        CREATE TABLE memo_counts (
            {rowid}user_id TEXT NOT NULL, function_id TEXT NOT NULL, hits {bigint} NOT NULL DEFAULT 0,
            misses {bigint} NOT NULL DEFAULT 0, PRIMARY KEY (user_id, function_id)
        );
        """,
    ),
    (
        11,
        """
        -- Execution environments (docs/environments.md): the task's environment spec as canonical
        -- JSON (mesh_agent/protocol/environment.py), NULL for the agent's own Python. It rides in the signed
        -- task frame, so neither a gateway nor the broker can change it.
        ALTER TABLE tasks ADD COLUMN env TEXT;
        """,
    ),
    (
        12,
        """
        -- Memoization (cloud_hub/store/memo.py): a cached call submitted while the same call of the
        -- same user is still queued or running joins that task instead of running twice.
        CREATE INDEX tasks_memo ON tasks (user_id, memo_key) WHERE memo_key IS NOT NULL;
        """,
    ),
    (
        13,
        """
        -- API tokens that end (docs/sdk.md, "Tokens"): an optional expiry (`mesh-hub token create
        -- --expires-in`) and a revocation time (`mesh-hub token revoke`). A token's public id is the
        -- start of its hash, so nothing more about the token is stored.
        ALTER TABLE api_tokens ADD COLUMN expires {real};
        ALTER TABLE api_tokens ADD COLUMN revoked {real};
        """,
    ),
    (
        14,
        """
        -- Result cursors per user (GET /v1/results/cursor, ?after=, the SDK stream): the global
        -- results.seq told a user, by the gaps between their own cursors, how many results everyone
        -- else got. user_seq numbers a user's results 1, 2, 3 (cloud_hub/store/sqlite.py,
        -- number_results), and result_cursors keeps each user's last number, so pruning old results
        -- never hands a number out twice. Results stored before this migration keep their global
        -- seq as their number (a cursor a client holds stays valid) and each user counts on from
        -- their own newest.
        ALTER TABLE results ADD COLUMN user_seq {bigint};
        UPDATE results SET user_seq = seq;
        CREATE TABLE result_cursors ({rowid}user_id TEXT PRIMARY KEY, last {bigint} NOT NULL);
        INSERT INTO result_cursors (user_id, last) SELECT user_id, MAX(seq) FROM results GROUP BY user_id;
        CREATE UNIQUE INDEX results_user_cursor ON results (user_id, user_seq);
        CREATE INDEX results_unnumbered ON results (seq) WHERE user_seq IS NULL;
        """,
    ),
    (
        15,
        """
        -- A stolen device is not a way into the user machine (docs/security.md, "What a stolen
        -- device key can and cannot do"). The SDK unpickles a result only from an endpoint whose
        -- owner marked it trusted (PUT /v1/endpoints/{id}/trusted, Client.set_endpoint_trusted), and
        -- only for that owner. From every other endpoint it decodes data only. Every endpoint starts
        -- untrusted, those enrolled before this migration too: a field device already deployed is the
        -- one a thief carries off. An owner marks the ones that stay in their hands (a laptop, an HPC
        -- login node). A custom object from an unmarked one fails with a message naming the setting.
        ALTER TABLE endpoints ADD COLUMN trusted {bigint} NOT NULL DEFAULT 0;
        """,
    ),
    (
        16,
        """
        -- A task that must start at once (a multiprocessing Process: docs/multiprocessing.md,
        -- "Start"): 1, else NULL. The dispatcher sends such tasks to their agent outside its fetch
        -- credit, and the agent starts each on a free worker or on one more, up to its cap.
        ALTER TABLE tasks ADD COLUMN start_now {bigint};
        """,
    ),
    (
        17,
        """
        -- Cancellation (docs/protocol.md, "Cancellation"): when the submitter cancelled a task (it
        -- then has its one cancelled result), and 1 while its agent has yet to confirm the cancel
        -- (the task was sent to it: leased or acked). The dispatcher sends such cancels in a tasks
        -- frame (cancel) on every session of that endpoint until the agent acks them (ack.c).
        ALTER TABLE tasks ADD COLUMN cancelled {real};
        ALTER TABLE tasks ADD COLUMN cancel_pending {bigint};
        CREATE INDEX tasks_cancel ON tasks (endpoint_id) WHERE cancel_pending IS NOT NULL;
        -- A driver's lease on a task group (a multiprocessing program, docs/multiprocessing.md,
        -- "Lease"): renewed by the program while it lives. Once expires passes, the hub cancels the
        -- group's unfinished tasks and drops the row.
        CREATE TABLE task_group_leases (
            {rowid}user_id TEXT NOT NULL, task_group_id TEXT NOT NULL, expires {real} NOT NULL, created {real} NOT NULL,
            PRIMARY KEY (user_id, task_group_id)
        );
        CREATE INDEX task_group_leases_expires ON task_group_leases (expires);
        """,
    ),
    (
        18,
        """
        -- 1 when the scheduler chose the task's endpoint (a selector: "auto", a list, tags), else
        -- NULL. The dispatcher sends an endpoint only a few such tasks ahead of its workers (its
        -- lookahead) and keeps the rest in the hub, where they can still move to an endpoint
        -- that runs out of work (docs/scheduler.md, "Late binding").
        ALTER TABLE tasks ADD COLUMN placed {bigint}
        """,
    ),
]


def migrations_for(dialect: str) -> list[tuple[int, str]]:
    """``(version, sql)`` in ``dialect`` (a key of ``DIALECTS``), the markers filled in."""
    words = DIALECTS[dialect]

    def fill(sql: str) -> str:
        for marker, word in words.items():
            sql = sql.replace(marker, word)
        return sql

    return [(version, fill(sql)) for version, sql in _SOURCE]


#: The migrations as SQLite runs them (cloud_hub/store/sqlite.py; also read by backup and tests).
MIGRATIONS: list[tuple[int, str]] = migrations_for("sqlite")
#: The same, as PostgreSQL runs them (cloud_hub/store/postgres.py).
PG_MIGRATIONS: list[tuple[int, str]] = migrations_for("postgres")
