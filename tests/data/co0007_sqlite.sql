-- The library's tables as the release before co0008 left a SQLite database: 'outbox db upgrade' to co0007
-- (its sqlite_master). tests/unit/test_migrations.py upgrades it to the head and compares.
CREATE TABLE outbox_schema_version (
	version_num VARCHAR(32) NOT NULL,
	CONSTRAINT outbox_schema_version_pkc PRIMARY KEY (version_num)
);
CREATE TABLE outbox_messages (
	seq INTEGER NOT NULL,
	message_id CHAR(32) NOT NULL,
	type VARCHAR(200) NOT NULL,
	payload JSON NOT NULL,
	headers JSON NOT NULL,
	created_at_ms BIGINT NOT NULL,
	published_at_ms BIGINT,
	attempts INTEGER DEFAULT '0' NOT NULL,
	next_attempt_at_ms BIGINT NOT NULL,
	dead_lettered_at_ms BIGINT,
	last_error TEXT,
	dedup_key VARCHAR(200),
	held_for VARCHAR(300),
	PRIMARY KEY (seq),
	UNIQUE (message_id)
);
CREATE TABLE outbox_inbox (
	message_id CHAR(32) NOT NULL,
	consumer VARCHAR(64) NOT NULL,
	type VARCHAR(200) NOT NULL,
	processed_at_ms BIGINT NOT NULL,
	PRIMARY KEY (message_id, consumer)
);
CREATE TABLE outbox_attempts (
	message_id CHAR(32) NOT NULL,
	consumer VARCHAR(64) NOT NULL,
	deliveries INTEGER NOT NULL,
	first_failed_at_ms BIGINT NOT NULL,
	last_failed_at_ms BIGINT NOT NULL,
	last_error TEXT NOT NULL,
	PRIMARY KEY (message_id, consumer)
);
CREATE TABLE outbox_dead_letters (
	id INTEGER NOT NULL,
	consumer VARCHAR(64) NOT NULL,
	message_id VARCHAR(64) NOT NULL,
	type VARCHAR(200),
	body TEXT NOT NULL,
	headers JSON NOT NULL,
	delivery_count INTEGER NOT NULL,
	last_error TEXT NOT NULL,
	first_failed_at_ms BIGINT NOT NULL,
	last_failed_at_ms BIGINT NOT NULL,
	replayed_at_ms BIGINT,
	fingerprint VARCHAR(32),
	PRIMARY KEY (id)
);
CREATE TABLE outbox_parked (
	message_id CHAR(32) NOT NULL,
	consumer VARCHAR(64) NOT NULL,
	entity_key VARCHAR(200) NOT NULL,
	entity_version BIGINT NOT NULL,
	envelope JSON NOT NULL,
	parked_at_ms BIGINT NOT NULL,
	PRIMARY KEY (message_id, consumer)
);
CREATE TABLE outbox_entity_versions (
	consumer VARCHAR(64) NOT NULL,
	entity_key VARCHAR(200) NOT NULL,
	version BIGINT NOT NULL,
	PRIMARY KEY (consumer, entity_key)
);
CREATE TABLE outbox_counters (
	consumer VARCHAR(64) NOT NULL,
	name VARCHAR(64) NOT NULL,
	value BIGINT NOT NULL,
	PRIMARY KEY (consumer, name)
);
CREATE TABLE outbox_task_receipts (
	task_id CHAR(32) NOT NULL,
	received_at_ms BIGINT NOT NULL,
	PRIMARY KEY (task_id)
);
CREATE TABLE outbox_workers (
	id CHAR(32) NOT NULL,
	name VARCHAR(255) NOT NULL,
	queues JSON NOT NULL,
	tasks JSON NOT NULL,
	started_at_ms BIGINT NOT NULL,
	heartbeat_at_ms BIGINT NOT NULL,
	PRIMARY KEY (id)
);
CREATE INDEX ix_outbox_pending ON outbox_messages (seq) WHERE published_at_ms IS NULL AND dead_lettered_at_ms IS NULL;
CREATE INDEX ix_outbox_due ON outbox_messages (next_attempt_at_ms, seq) WHERE published_at_ms IS NULL AND dead_lettered_at_ms IS NULL;
CREATE UNIQUE INDEX ux_outbox_dedup ON outbox_messages (dedup_key) WHERE published_at_ms IS NULL AND dead_lettered_at_ms IS NULL AND dedup_key IS NOT NULL;
CREATE INDEX ix_outbox_dead ON outbox_messages (seq) WHERE dead_lettered_at_ms IS NOT NULL;
CREATE INDEX ix_outbox_published ON outbox_messages (published_at_ms) WHERE published_at_ms IS NOT NULL;
CREATE INDEX ix_outbox_held ON outbox_messages (held_for) WHERE published_at_ms IS NULL AND dead_lettered_at_ms IS NULL AND held_for IS NOT NULL;
CREATE INDEX ix_outbox_inbox_processed ON outbox_inbox (processed_at_ms);
CREATE INDEX ix_outbox_dead_letters_message ON outbox_dead_letters (message_id);
CREATE INDEX ix_outbox_dead_letters_consumer ON outbox_dead_letters (consumer);
CREATE INDEX ix_outbox_dead_letters_group ON outbox_dead_letters (fingerprint, id, last_failed_at_ms) WHERE replayed_at_ms IS NULL;
CREATE INDEX ix_outbox_parked_entity ON outbox_parked (consumer, entity_key, entity_version);
CREATE INDEX ix_outbox_receipts_at ON outbox_task_receipts (received_at_ms);
INSERT INTO outbox_schema_version (version_num) VALUES ('co0007');
