"""BatchStore: objects on disk, owned by a key's name, reachable only through well-formed ids."""

from __future__ import annotations

from lmserve.server.batch.store import BatchJob, BatchStore


def test_files_and_jobs_round_trip_per_owner(tmp_path):
    store = BatchStore(tmp_path / "b")
    assert store.jobs() == [] and not (tmp_path / "b").exists()  # nothing is created before the first write
    f = store.add_file(b'{"a": 1}\n', "in.jsonl", "batch", "alice")
    assert store.content_path(f.id).read_bytes() == b'{"a": 1}\n'
    assert store.get_file(f.id, "alice") == f and store.get_file(f.id, "bob") is None
    job = BatchJob(store.new_id("batch_"), "/v1/completions", f.id, "24h", "alice", store.new_id("file-"),
                   store.new_id("file-"))
    job.mark("in_progress")
    store.save_job(job)
    again = store.get_job(job.id, "alice")
    assert again == job and again.to_openai()["in_progress_at"] == job.times["in_progress_at"]
    assert store.get_job(job.id, "bob") is None and [j.id for j in store.jobs("alice")] == [job.id]
    assert not list((tmp_path / "b").rglob(".*.tmp"))  # atomic writes leave no temporary behind
    store.delete_file(f)
    assert store.get_file(f.id, "alice") is None and not store.content_path(f.id).exists()


def test_ids_that_are_not_ours_never_reach_a_path(tmp_path):
    store = BatchStore(tmp_path / "b")
    (tmp_path / "secret.json").write_text('{"id": "x"}')
    for bad in ("../secret", "file-../../secret", "batch_" + "0" * 31 + "/", "file-" + "A" * 32, ""):
        assert store.get_file(bad, "alice") is None
        assert store.get_job(bad, None) is None
