-- The migration this canonical definition corresponds to, and the partitions
-- a fresh database starts with. Add a row here with every new migration.
INSERT INTO outbox.schema_migrations (version, name)
VALUES
(1, '0001_initial'), (2, '0002_inbox_replay'), (3, '0003_archival'), (4, '0004_wakeup_sequence'),
(5, '0005_claim_mark_path'), (6, '0006_poison_proof'),
(7, '0007_worker_compatibility'),
(8, '0008_broker_loss_repair'),
(9, '0009_inbox_batches'),
(10, '0010_archival_operations'),
(11, '0011_emit_path'),
(12, '0012_consumer_failures'),
(13, '0013_least_privilege'),
(14, '0014_command_inbox'),
(15, '0015_upcasters'),
(16, '0016_dead_letter_operations'),
(17, '0017_notices_and_cloudevents'),
(18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

SELECT count(*) AS partitions_created FROM outbox.create_partitions();
