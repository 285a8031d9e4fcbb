"""The trace analysis as named SQL: read these to write your own queries.

Every statement runs unchanged in DuckDB (what `rolloutdb trace` uses) and in SQLite
3.40+. They read base tables that `rolloutdb.store.trace.analysis` builds by stacking, for each
trace file it was given, the file's table of the same name (``UNION ALL``), with the
columns `BASE_COLUMNS` names and two more in front:

``job`` is 'run' for the traces under analysis (one job, however many times it was
stopped and resumed, in one or several files) and 'baseline' for a run of the same job
that never stopped. ``src`` numbers the files of a job; (job, src, seq) names an event and
(job, src, run) a run. ``trace_runs`` is each file's ``runs`` table. docs/trace.md
describes every event and field.

`VIEWS` build on each other in order (create them as views, in that order); `QUERIES`
are the figures `rolloutdb trace` prints. Times are seconds.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- base tables

# Trace-file table -> the columns the figures read (after job, src). Each is one event
# type (see rolloutdb.store.trace.events.EVENT_FIELDS), a list table, or `runs` (as trace_runs).
BASE_COLUMNS: dict[str, str] = {
    "trace_runs": "run, run_id, first_t, last_t",
    "group_reserved": "seq, t, run, prompt_id, group_id, epoch",
    "group_sealed": "seq, t, run, prompt_id, group_id",
    "group_discarded": "seq, t, run, prompt_id, group_id",
    "group_published": "seq, t, run, group_id",
    "published_tokens": "seq, policy_version, tokens",
    "train_step": "seq, t, run, step, policy_version, batch_age",
    "trained_groups": "seq, group_id",
    "restore_done": "seq, t, run, snapshot_seq, cut_time, decoded_at",
    "attempt_abandoned": "seq, t, run, prompt_id, generation_index, attempt, group_id, reason",
    "attempt_dispatched": "seq, t, run, group_id, prompt_id, generation_index, attempt, prefix_tokens",
    "call_cut": "seq, t, run, group_id, prompt_id, generation_index, attempt, tokens",
    "call_finished": "seq, t, run, group_id, prompt_id, generation_index, attempt, turn, tokens",
    "turn_committed": "seq, t, run, group_id, prompt_id, generation_index, attempt, turn, tokens",
    "episode_restored": "seq, t, run, group_id, prompt_id, generation_index, attempt, from_attempt, turn, tokens",
    "call_fallback": "seq, t, run, attempt_id, turn, reason, group_id, prompt_id, generation_index, attempt, tokens",
}

# --------------------------------------------------------------------------- views

RUNS = """
-- One row per run (process) of a job, in the order the runs started. started / ended:
-- its first and last event (the writer keeps them in each file's runs table).
--   downtime_before: from the previous run's last event to this run's first (0 for
--     the first run, and 0 if the two overlap);
--   downtime_until: all downtime of the job up to this run.
-- A job's *effective* time of an event in this run is
--   t - job_started - downtime_until,
-- the time the job would show had it never been down.
WITH ordered AS (
    SELECT job, src, run, run_id, first_t AS started, last_t AS ended,
           row_number() OVER (PARTITION BY job ORDER BY first_t, run_id) AS run_no,
           lag(last_t) OVER (PARTITION BY job ORDER BY first_t, run_id) AS previous_ended
    FROM trace_runs
), gaps AS (
    SELECT job, src, run, run_id, started, ended, run_no,
           CASE WHEN previous_ended IS NULL OR started <= previous_ended THEN 0.0
                ELSE started - previous_ended END AS downtime_before
    FROM ordered
)
SELECT job, src, run, run_id, run_no, started, ended, downtime_before,
       sum(downtime_before) OVER (PARTITION BY job ORDER BY run_no) AS downtime_until,
       min(started) OVER (PARTITION BY job) AS job_started
FROM gaps
"""

STOPS = """
-- One row per stop: the boundary between run stop_no (killed or stopped) and the run
-- after it, which resumed the job.
--   stopped_at: the stopped run's last event (the stop, as far as the trace knows);
--   snapshot_seq, cut_time: the snapshot the resumed run restored (its first
--     restore_done event); NULL when it restored none;
--   cut: cut_time, or stopped_at when no snapshot was restored. What happened after
--     the cut was lost with the stop and had to be done again;
--   decoded_at: the cut's decode point at prefix level (when it read the running calls,
--     just before cut_time); NULL below prefix level, where a cut reads no call;
--   decode_point: decoded_at, else cut_time. A token decoded after it was not the cut's.
SELECT s.job, s.run_no AS stop_no, s.run_id AS stopped_run, r.run_id AS resumed_run,
       s.ended AS stopped_at, r.started AS resumed_at, r.downtime_before AS downtime,
       rd.t AS restored_at, rd.snapshot_seq, rd.cut_time,
       coalesce(rd.cut_time, s.ended) AS cut,
       rd.decoded_at, coalesce(rd.decoded_at, rd.cut_time) AS decode_point
FROM runs s
JOIN runs r ON r.job = s.job AND r.run_no = s.run_no + 1
LEFT JOIN (
    SELECT job, src, run, t, snapshot_seq, cut_time, decoded_at,
           row_number() OVER (PARTITION BY job, src, run ORDER BY t, seq) AS nth
    FROM restore_done
) rd ON rd.job = r.job AND rd.src = r.src AND rd.run = r.run AND rd.nth = 1
"""

GROUP_TIMELINE = """
-- Every group_reserved, group_sealed and group_discarded event with its run number (and
-- a reservation's epoch), its effective time (downtime removed) and whether it was
-- *kept*: it happened in the last run, or before the cut of the snapshot that the next
-- run restored. An event that was not kept (a group sealed after the cut, say) was lost
-- with the stop and happened again later.
WITH group_events AS (
    SELECT job, src, seq, t, run, 'group_reserved' AS event, prompt_id, group_id, epoch FROM group_reserved
    UNION ALL
    SELECT job, src, seq, t, run, 'group_sealed' AS event, prompt_id, group_id, NULL AS epoch FROM group_sealed
    UNION ALL
    SELECT job, src, seq, t, run, 'group_discarded' AS event, prompt_id, group_id, NULL AS epoch FROM group_discarded
)
SELECT e.job, e.src, e.seq, e.t, e.event, e.prompt_id, e.group_id, e.epoch, ru.run_no,
       e.t - ru.job_started - ru.downtime_until AS effective_t,
       CASE WHEN st.stop_no IS NULL OR e.t <= st.cut THEN 1 ELSE 0 END AS kept
FROM group_events e
JOIN runs ru ON ru.job = e.job AND ru.src = e.src AND ru.run = e.run
LEFT JOIN stops st ON st.job = e.job AND st.stop_no = ru.run_no
"""

THROWN_AWAY_ATTEMPTS = """
-- Thrown-away time, one row per attempt abandoned with reason 'restart': from the later
-- of the attempt's last attempt_dispatched and its latest turn_committed (same
-- group_id, prompt_id, generation_index, attempt; both at or before the cut) to the cut_time of
-- the snapshot that the resumed run restored, floored at 0. The attempt had been working
-- since its dispatch; a turn committed before the cut is in the snapshot and kept (turn-
-- level recovery), so only the time since it is thrown away. Without turn_committed
-- events (group-level recovery) this is cut_time - last dispatch.
-- The abandonment belongs to the first stop whose restored cut held the attempt: the
-- first, before the run that recorded it, with a cut at or after the attempt's first
-- dispatch. Normally the run that restored is the run that recorded it; a resumed run
-- stopped before it restarted a restored group leaves the abandon to a later run, and
-- the attempt is still the earlier stop's (its work was lost there). Without a dispatch
-- in the trace: the first stop at or after the recording run whose resumed run restored
-- a snapshot.
WITH abandoned AS (
    SELECT a.job, a.prompt_id, a.generation_index, a.attempt, a.group_id, ru.run_no
    FROM attempt_abandoned a
    JOIN runs ru ON ru.job = a.job AND ru.src = a.src AND ru.run = a.run
    WHERE a.reason = 'restart'
), its_dispatches AS (
    -- Every dispatch of each abandoned attempt: the one read of the dispatches.
    SELECT x.job, x.prompt_id, x.generation_index, x.attempt, x.group_id, d.t
    FROM (SELECT DISTINCT job, prompt_id, generation_index, attempt, group_id FROM abandoned) x
    JOIN attempt_dispatched d
      ON d.job = x.job AND d.prompt_id = x.prompt_id AND d.group_id = x.group_id
     AND d.generation_index = x.generation_index AND d.attempt = x.attempt
), assigned AS (
    SELECT a.job, a.prompt_id, a.generation_index, a.attempt, a.group_id, a.run_no,
           coalesce(
               (SELECT min(st.stop_no) FROM stops st
                WHERE st.job = a.job AND st.cut_time IS NOT NULL AND st.stop_no <= a.run_no - 1
                  AND st.cut_time >= (SELECT min(i.t) FROM its_dispatches i
                                      WHERE i.job = a.job AND i.prompt_id = a.prompt_id AND i.group_id = a.group_id
                                        AND i.generation_index = a.generation_index AND i.attempt = a.attempt)),
               (SELECT min(st.stop_no) FROM stops st
                WHERE st.job = a.job AND st.cut_time IS NOT NULL AND st.stop_no >= a.run_no - 1)) AS stop_no
    FROM abandoned a
), dispatched AS (
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, st.cut_time,
           st.decoded_at, st.decode_point, max(d.t) AS dispatched_at
    FROM assigned x
    JOIN stops st ON st.job = x.job AND st.stop_no = x.stop_no
    LEFT JOIN its_dispatches d
           ON d.job = x.job AND d.prompt_id = x.prompt_id AND d.group_id = x.group_id AND d.generation_index = x.generation_index
          AND d.attempt = x.attempt AND d.t <= st.cut_time
    GROUP BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, st.cut_time,
             st.decoded_at, st.decode_point
), committed AS (
    -- The attempt's turns durable by the cut: after its dispatch (a prompt seen in an
    -- earlier epoch reuses its attempt numbers) and at or before the cut.
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt,
           max(c.t) AS committed_at, max(c.turn) AS last_committed_turn
    FROM dispatched x
    JOIN turn_committed c
      ON c.job = x.job AND c.prompt_id = x.prompt_id AND c.group_id = x.group_id AND c.generation_index = x.generation_index
     AND c.attempt = x.attempt AND c.t <= x.cut_time AND (x.dispatched_at IS NULL OR c.t >= x.dispatched_at)
    GROUP BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
), cut_at AS (
    -- Prefix level: a call the restored cut froze (call_cut at the cut's time) kept its
    -- work up to the cut.
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, max(c.t) AS cut_at
    FROM dispatched x
    JOIN call_cut c
      ON c.job = x.job AND c.prompt_id = x.prompt_id AND c.group_id = x.group_id AND c.generation_index = x.generation_index
     AND c.attempt = x.attempt AND abs(c.t - x.cut_time) < 1e-6
    GROUP BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
), since AS (
    SELECT x.*, c.committed_at, c.last_committed_turn,
           CASE WHEN k.cut_at IS NOT NULL THEN x.cut_time
                WHEN c.committed_at IS NOT NULL AND (x.dispatched_at IS NULL OR c.committed_at > x.dispatched_at)
                THEN c.committed_at ELSE x.dispatched_at END AS working_since
    FROM dispatched x
    LEFT JOIN committed c ON c.job = x.job AND c.stop_no = x.stop_no AND c.prompt_id = x.prompt_id AND c.group_id = x.group_id
     AND c.generation_index = x.generation_index AND c.attempt = x.attempt
    LEFT JOIN cut_at k ON k.job = x.job AND k.stop_no = x.stop_no AND k.prompt_id = x.prompt_id AND k.group_id = x.group_id
     AND k.generation_index = x.generation_index AND k.attempt = x.attempt
)
SELECT job, stop_no, prompt_id, generation_index, attempt, group_id, dispatched_at, committed_at,
       last_committed_turn, cut_time, decoded_at, decode_point,
       CASE WHEN cut_time - working_since < 0 THEN 0.0 ELSE cut_time - working_since END AS thrown_away_s
FROM since
"""

KEPT_ATTEMPTS = """
-- What a stop kept, one row per attempt abandoned with reason 'restart' (the attempts of
-- thrown_away_attempts, with their thrown-away time):
--   decoded_tokens: tokens its calls decoded before the stop (call_finished from its
--     last dispatch to the stopped run's last event), and at prefix level the tokens its
--     call running at the restored cut had decoded by then (call_cut at the cut), when
--     that call did not finish before the stop. A call still decoding at a SIGKILL left
--     no other event: what it decoded after the cut is not counted (its time is in
--     thrown_away_s);
--   turns_kept, kept_tokens: what the resumed run's episode_restored (from_attempt =
--     this attempt) continued from, plus the prefix its next attempt was dispatched with
--     (attempt_dispatched.prefix_tokens), less what this attempt had itself been
--     restored with at an earlier stop (kept then, not decoded by it);
--   decoded_by_cut: of those, what was decoded by the restored cut's decode point
--     (decode_point: finished calls by then, the call the cut froze, and the calls it
--     read and did not keep): what a snapshot could have kept;
--   fallback_tokens: what the cut read and did not keep, each with a reason (its
--     call_fallback events: a turn that restarts, a tail of a newer policy version);
--   unexplained_tokens: at prefix level (a cut that read the running calls: decoded_at
--     set), decoded_by_cut - kept_tokens - fallback_tokens when positive: tokens decoded
--     by the cut that the resumed run neither kept nor has a reason for (0 when recovery
--     and its accounting agree). NULL below prefix level, whose cuts keep only committed
--     turns by design;
--   redone_tokens: decoded_tokens - kept_tokens, the finished calls whose turns were not
--     in the snapshot and are generated again.
WITH decoded AS (
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, sum(c.tokens) AS tokens
    FROM thrown_away_attempts x
    JOIN stops st ON st.job = x.job AND st.stop_no = x.stop_no
    JOIN call_finished c
      ON c.job = x.job AND c.prompt_id = x.prompt_id AND c.group_id = x.group_id AND c.generation_index = x.generation_index
     AND c.attempt = x.attempt AND c.t <= st.stopped_at AND (x.dispatched_at IS NULL OR c.t >= x.dispatched_at)
    GROUP BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
), by_cut AS (
    -- What its finished calls had decoded by the restored cut: finished by its decode
    -- point, or committed by the cut (the pump's flush after the engine read commits a
    -- call whose call_finished the pump wrote after the decode point: the snapshot holds
    -- its turn whole).
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, sum(c.tokens) AS tokens
    FROM thrown_away_attempts x
    JOIN call_finished c
      ON c.job = x.job AND c.prompt_id = x.prompt_id AND c.group_id = x.group_id AND c.generation_index = x.generation_index
     AND c.attempt = x.attempt AND (x.dispatched_at IS NULL OR c.t >= x.dispatched_at)
     AND (c.t <= x.decode_point OR EXISTS (
          SELECT 1 FROM turn_committed tc
          WHERE tc.job = x.job AND tc.prompt_id = x.prompt_id AND tc.group_id = x.group_id AND tc.generation_index = x.generation_index
            AND tc.attempt = x.attempt AND tc.turn = c.turn AND tc.t >= c.t AND tc.t <= x.cut_time))
    GROUP BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
), saved_whole AS (
    -- Prefix level: a call that finished by the decode point but whose turn was committed
    -- only after the cut is in the cut's call_cut as a whole prefix (the pump had absorbed
    -- it): its tokens are in by_cut / decoded already, so its call_cut is not counted again.
    SELECT DISTINCT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
    FROM thrown_away_attempts x
    JOIN call_finished f
      ON f.job = x.job AND f.prompt_id = x.prompt_id AND f.group_id = x.group_id AND f.generation_index = x.generation_index
     AND f.attempt = x.attempt AND f.t <= x.decode_point AND (x.dispatched_at IS NULL OR f.t >= x.dispatched_at)
    WHERE NOT EXISTS (
        SELECT 1 FROM turn_committed tc
        WHERE tc.job = x.job AND tc.prompt_id = x.prompt_id AND tc.group_id = x.group_id AND tc.generation_index = x.generation_index
          AND tc.attempt = x.attempt AND tc.turn = f.turn AND tc.t <= x.cut_time)
), frozen AS (
    -- Its call running at the restored cut, frozen there (prefix level), finished later or not.
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, max(c.tokens) AS tokens
    FROM thrown_away_attempts x
    JOIN call_cut c
      ON c.job = x.job AND c.prompt_id = x.prompt_id AND c.group_id = x.group_id AND c.generation_index = x.generation_index
     AND c.attempt = x.attempt AND abs(c.t - x.cut_time) < 1e-6
    WHERE NOT EXISTS (
        SELECT 1 FROM saved_whole w
        WHERE w.job = x.job AND w.stop_no = x.stop_no AND w.prompt_id = x.prompt_id AND w.group_id = x.group_id
          AND w.generation_index = x.generation_index AND w.attempt = x.attempt)
    GROUP BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
), cut AS (
    -- The call running at the restored cut, frozen there, unless it finished after the
    -- decode point and before the stop (then its tokens are in decoded). Cut events carry
    -- the cut's own time.
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, max(c.tokens) AS tokens
    FROM thrown_away_attempts x
    JOIN stops st ON st.job = x.job AND st.stop_no = x.stop_no
    JOIN call_cut c
      ON c.job = x.job AND c.prompt_id = x.prompt_id AND c.group_id = x.group_id AND c.generation_index = x.generation_index
     AND c.attempt = x.attempt AND abs(c.t - x.cut_time) < 1e-6
    WHERE NOT EXISTS (
        SELECT 1 FROM call_finished f
        WHERE f.job = x.job AND f.prompt_id = x.prompt_id AND f.group_id = x.group_id AND f.generation_index = x.generation_index
          AND f.attempt = x.attempt AND f.t > x.decode_point AND f.t <= st.stopped_at)
      AND NOT EXISTS (
        SELECT 1 FROM saved_whole w
        WHERE w.job = x.job AND w.stop_no = x.stop_no AND w.prompt_id = x.prompt_id AND w.group_id = x.group_id
          AND w.generation_index = x.generation_index AND w.attempt = x.attempt)
    GROUP BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
), restored AS (
    -- The first episode_restored after the stop that continues this attempt.
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, e.turn, e.tokens,
           row_number() OVER (PARTITION BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
                              ORDER BY e.t, e.src, e.seq) AS nth
    FROM thrown_away_attempts x
    JOIN stops st ON st.job = x.job AND st.stop_no = x.stop_no
    JOIN episode_restored e
      ON e.job = x.job AND e.prompt_id = x.prompt_id AND e.group_id = x.group_id AND e.generation_index = x.generation_index
     AND e.from_attempt = x.attempt AND e.t > st.stopped_at
), prefixed AS (
    -- The first dispatch after the stop of the attempt that replaces this one, with the
    -- prefix it continues from (prefix level).
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, coalesce(d.prefix_tokens, 0) AS tokens,
           row_number() OVER (PARTITION BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
                              ORDER BY d.t, d.src, d.seq) AS nth
    FROM thrown_away_attempts x
    JOIN stops st ON st.job = x.job AND st.stop_no = x.stop_no
    JOIN attempt_dispatched d
      ON d.job = x.job AND d.prompt_id = x.prompt_id AND d.group_id = x.group_id AND d.generation_index = x.generation_index
     AND d.attempt = x.attempt + 1 AND d.t > st.stopped_at
), inherited AS (
    -- What this attempt itself started from: its own episode_restored before the stop.
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, e.turn, e.tokens,
           row_number() OVER (PARTITION BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
                              ORDER BY e.t DESC, e.src DESC, e.seq DESC) AS nth
    FROM thrown_away_attempts x
    JOIN stops st ON st.job = x.job AND st.stop_no = x.stop_no
    JOIN episode_restored e
      ON e.job = x.job AND e.prompt_id = x.prompt_id AND e.group_id = x.group_id AND e.generation_index = x.generation_index
     AND e.attempt = x.attempt AND e.t <= st.stopped_at
), own_prefix AS (
    -- The prefix this attempt itself was dispatched with (its last dispatch before the
    -- stop): in its cut tokens and in the next attempt's prefix, kept at an earlier stop.
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt, coalesce(d.prefix_tokens, 0) AS tokens,
           row_number() OVER (PARTITION BY x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt
                              ORDER BY d.t DESC, d.src DESC, d.seq DESC) AS nth
    FROM thrown_away_attempts x
    JOIN stops st ON st.job = x.job AND st.stop_no = x.stop_no
    JOIN attempt_dispatched d
      ON d.job = x.job AND d.prompt_id = x.prompt_id AND d.group_id = x.group_id AND d.generation_index = x.generation_index
     AND d.attempt = x.attempt AND d.t <= st.stopped_at
), fell_calls AS (
    -- What the restored cut read of its calls and did not keep (call_fallback at the
    -- cut's time), less the prefix the attempt was itself restored with when the call
    -- is the one of its restored turn (not this attempt's decoding). open: the call had
    -- not finished by the decode point (its tokens are in no call_finished of by_cut).
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt,
           CASE WHEN i.turn IS NOT NULL AND fb.turn = i.turn AND fb.reason <> 'newer_policy_version'
                THEN CASE WHEN coalesce(fb.tokens, 0) > coalesce(o.tokens, 0)
                          THEN coalesce(fb.tokens, 0) - coalesce(o.tokens, 0) ELSE 0 END
                ELSE coalesce(fb.tokens, 0) END AS tokens,
           CASE WHEN EXISTS (
               SELECT 1 FROM call_finished f
               WHERE f.job = x.job AND f.prompt_id = x.prompt_id AND f.group_id = x.group_id AND f.generation_index = x.generation_index
                 AND f.attempt = x.attempt AND f.turn = fb.turn AND f.t <= x.decode_point
                 AND (x.dispatched_at IS NULL OR f.t >= x.dispatched_at)) THEN 0 ELSE 1 END AS open
    FROM thrown_away_attempts x
    JOIN call_fallback fb
      ON fb.job = x.job AND fb.prompt_id = x.prompt_id AND fb.group_id = x.group_id AND fb.generation_index = x.generation_index
     AND fb.attempt = x.attempt AND abs(fb.t - x.cut_time) < 1e-6
    LEFT JOIN inherited i ON i.job = x.job AND i.stop_no = x.stop_no AND i.prompt_id = x.prompt_id AND i.group_id = x.group_id
     AND i.generation_index = x.generation_index AND i.attempt = x.attempt AND i.nth = 1
    LEFT JOIN own_prefix o ON o.job = x.job AND o.stop_no = x.stop_no AND o.prompt_id = x.prompt_id AND o.group_id = x.group_id
     AND o.generation_index = x.generation_index AND o.attempt = x.attempt AND o.nth = 1
), fell AS (
    SELECT job, stop_no, group_id, prompt_id, generation_index, attempt, sum(tokens) AS tokens,
           sum(CASE WHEN open = 1 THEN tokens ELSE 0 END) AS open_tokens
    FROM fell_calls
    GROUP BY job, stop_no, group_id, prompt_id, generation_index, attempt
), kept AS (
    SELECT x.job, x.stop_no, x.group_id, x.prompt_id, x.generation_index, x.attempt,
           -- The call the cut froze holds its own prefix only while it is still the call
           -- of the turn it started at: once it committed a turn, it froze a later one.
           coalesce(d.tokens, 0) + CASE WHEN x.last_committed_turn IS NOT NULL THEN coalesce(c.tokens, 0)
                                        WHEN coalesce(c.tokens, 0) > coalesce(o.tokens, 0)
                                        THEN coalesce(c.tokens, 0) - coalesce(o.tokens, 0) ELSE 0 END AS decoded_tokens,
           coalesce(b.tokens, 0) + CASE WHEN x.last_committed_turn IS NOT NULL THEN coalesce(fz.tokens, 0)
                                        WHEN coalesce(fz.tokens, 0) > coalesce(o.tokens, 0)
                                        THEN coalesce(fz.tokens, 0) - coalesce(o.tokens, 0) ELSE 0 END
             + coalesce(fl.open_tokens, 0) AS decoded_by_cut,
           coalesce(fl.tokens, 0) AS fallback_tokens,
           coalesce(r.turn, 0) AS turns_kept,
           -- Its own prefix (kept at an earlier stop) belongs to the turn it started at:
           -- in the restored turns' tokens once that turn is among them, else in the
           -- next attempt's prefix.
           CASE WHEN coalesce(r.turn, 0) > coalesce(i.turn, 0)
                THEN coalesce(r.tokens, 0) - coalesce(i.tokens, 0) - coalesce(o.tokens, 0) + coalesce(pf.tokens, 0)
                ELSE coalesce(r.tokens - coalesce(i.tokens, 0), 0)
                     + CASE WHEN coalesce(pf.tokens, 0) > coalesce(o.tokens, 0)
                            THEN coalesce(pf.tokens, 0) - coalesce(o.tokens, 0) ELSE 0 END END AS kept_tokens
    FROM thrown_away_attempts x
    LEFT JOIN decoded d ON d.job = x.job AND d.stop_no = x.stop_no AND d.prompt_id = x.prompt_id AND d.group_id = x.group_id
     AND d.generation_index = x.generation_index AND d.attempt = x.attempt
    LEFT JOIN cut c ON c.job = x.job AND c.stop_no = x.stop_no AND c.prompt_id = x.prompt_id AND c.group_id = x.group_id
     AND c.generation_index = x.generation_index AND c.attempt = x.attempt
    LEFT JOIN by_cut b ON b.job = x.job AND b.stop_no = x.stop_no AND b.prompt_id = x.prompt_id AND b.group_id = x.group_id
     AND b.generation_index = x.generation_index AND b.attempt = x.attempt
    LEFT JOIN frozen fz ON fz.job = x.job AND fz.stop_no = x.stop_no AND fz.prompt_id = x.prompt_id AND fz.group_id = x.group_id
     AND fz.generation_index = x.generation_index AND fz.attempt = x.attempt
    LEFT JOIN restored r ON r.job = x.job AND r.stop_no = x.stop_no AND r.prompt_id = x.prompt_id AND r.group_id = x.group_id
     AND r.generation_index = x.generation_index AND r.attempt = x.attempt AND r.nth = 1
    LEFT JOIN prefixed pf ON pf.job = x.job AND pf.stop_no = x.stop_no AND pf.prompt_id = x.prompt_id AND pf.group_id = x.group_id
     AND pf.generation_index = x.generation_index AND pf.attempt = x.attempt AND pf.nth = 1
    LEFT JOIN inherited i ON i.job = x.job AND i.stop_no = x.stop_no AND i.prompt_id = x.prompt_id AND i.group_id = x.group_id
     AND i.generation_index = x.generation_index AND i.attempt = x.attempt AND i.nth = 1
    LEFT JOIN own_prefix o ON o.job = x.job AND o.stop_no = x.stop_no AND o.prompt_id = x.prompt_id AND o.group_id = x.group_id
     AND o.generation_index = x.generation_index AND o.attempt = x.attempt AND o.nth = 1
    LEFT JOIN fell fl ON fl.job = x.job AND fl.stop_no = x.stop_no AND fl.prompt_id = x.prompt_id AND fl.group_id = x.group_id
     AND fl.generation_index = x.generation_index AND fl.attempt = x.attempt
)
SELECT x.job, x.stop_no, x.prompt_id, x.generation_index, x.attempt, x.group_id,
       k.decoded_tokens, k.decoded_by_cut, k.turns_kept, k.kept_tokens, k.fallback_tokens,
       CASE WHEN x.decoded_at IS NULL THEN NULL
            WHEN k.decoded_by_cut - k.kept_tokens - k.fallback_tokens > 0
            THEN k.decoded_by_cut - k.kept_tokens - k.fallback_tokens ELSE 0 END AS unexplained_tokens,
       k.decoded_tokens - k.kept_tokens AS redone_tokens,
       x.last_committed_turn, x.dispatched_at, x.committed_at, x.cut_time, x.thrown_away_s
FROM thrown_away_attempts x
JOIN kept k ON k.job = x.job AND k.stop_no = x.stop_no AND k.prompt_id = x.prompt_id AND k.group_id = x.group_id
 AND k.generation_index = x.generation_index AND k.attempt = x.attempt
"""

LOST_PROGRESS_GROUPS = """
-- Lost progress, one row per group that was running at a stop: how much later, on the
-- job's effective timeline, its prompt was sealed than the same prompt's group in the
-- baseline on the baseline's effective timeline.
-- Running at a stop: a group_reserved before the stop (kept, or in the stopped run
-- itself) followed by neither a kept group_sealed nor a kept group_discarded of that
-- group up to the cut. A group discarded by the cut (zero reward variance, say) is
-- settled: the restored state knows it, and it will never be sealed. Of several
-- reservations of one (epoch, prompt), only the latest counts: a resume that rewinds to
-- a trainer checkpoint hands the groups it held back to the spare pool, which reserves
-- them again (a file without epochs: the latest reservation of each prompt). Two groups
-- of one prompt in different epochs (the next epoch drew it while the earlier group ran)
-- are two rows. A rewinding resume also records each group it withdrew as a
-- group_discarded (reason 'rewind'): settled from then on, whether or not its prompt was
-- reserved again by the next stop.
-- Sealed after the stop: the prompt's kept group_sealed events in later runs, the k-th
-- for the k-th of its groups running at the stop (by reservation time).
-- A prompt sealed several times (epochs) is matched occurrence by occurrence: the n-th
-- kept seal of the prompt in the run against the n-th seal in the baseline.
WITH reserved AS (
    SELECT prompt_id, group_id, epoch, t, run_no, kept FROM group_timeline
    WHERE job = 'run' AND event = 'group_reserved'
), seals AS (
    SELECT job, prompt_id, t, run_no, effective_t,
           row_number() OVER (PARTITION BY job, prompt_id ORDER BY t, src, seq) AS occurrence
    FROM group_timeline
    WHERE event = 'group_sealed' AND kept = 1
), held AS (
    SELECT st.stop_no, r.prompt_id, r.group_id, r.t AS reserved_at,
           row_number() OVER (PARTITION BY st.stop_no, r.prompt_id, r.epoch ORDER BY r.t DESC, r.group_id DESC) AS latest
    FROM stops st
    JOIN reserved r ON r.run_no <= st.stop_no AND (r.run_no = st.stop_no OR r.kept = 1)
    WHERE st.job = 'run'
), settled AS (
    SELECT prompt_id, group_id, t, run_no FROM group_timeline
    WHERE job = 'run' AND event IN ('group_sealed', 'group_discarded') AND kept = 1
), settled_before AS (
    SELECT st.stop_no, s.prompt_id, s.group_id, max(s.t) AS settled_at
    FROM stops st
    JOIN settled s ON s.run_no <= st.stop_no AND s.t <= st.cut
    WHERE st.job = 'run'
    GROUP BY st.stop_no, s.prompt_id, s.group_id
), running AS (
    SELECT h.stop_no, h.prompt_id, h.group_id, h.reserved_at,
           row_number() OVER (PARTITION BY h.stop_no, h.prompt_id ORDER BY h.reserved_at, h.group_id) AS k
    FROM held h
    LEFT JOIN settled_before b
           ON b.stop_no = h.stop_no AND b.prompt_id = h.prompt_id AND coalesce(b.group_id, -1) = coalesce(h.group_id, -1)
    WHERE h.latest = 1 AND (b.settled_at IS NULL OR b.settled_at < h.reserved_at)
), sealed_after AS (
    SELECT r.stop_no, r.prompt_id, s.occurrence, s.effective_t,
           row_number() OVER (PARTITION BY r.stop_no, r.prompt_id ORDER BY s.t, s.occurrence) AS nth
    FROM (SELECT DISTINCT stop_no, prompt_id FROM running) r
    JOIN seals s ON s.job = 'run' AND s.prompt_id = r.prompt_id AND s.run_no > r.stop_no
)
SELECT r.stop_no, r.prompt_id, r.group_id, a.occurrence,
       a.effective_t AS sealed_effective_t,
       b.effective_t AS baseline_sealed_effective_t,
       a.effective_t - b.effective_t AS lost_s
FROM running r
LEFT JOIN sealed_after a ON a.stop_no = r.stop_no AND a.prompt_id = r.prompt_id AND a.nth = r.k
LEFT JOIN seals b ON b.job = 'baseline' AND b.prompt_id = r.prompt_id AND b.occurrence = a.occurrence
"""

BATCH_AGE_STEPS = """
-- Batch age, one row per train_step event: the token-weighted number of policy updates
-- between generating each token and training on it,
--   sum over tokens of (trained_version - version that produced the token) / tokens,
-- where trained_version is the train step's policy_version (the version before the
-- step's update; step - 1 when the event has none). A group's tokens are the
-- version_token_counts (published_tokens) of its latest group_published before the step, so a call that ran
-- across a refit counts each token under the version that produced it. Environment
-- tokens (negative versions) do not count. logged_batch_age is what the trainer logged
-- in the same event; the two must agree.
WITH steps AS (
    SELECT job, src, seq, t, run, step,
           coalesce(policy_version, step - 1) AS trained_version,
           batch_age AS logged_batch_age
    FROM train_step
), trained AS (
    SELECT s.job, s.src, s.seq, s.t, s.trained_version, g.group_id
    FROM steps s
    JOIN trained_groups g ON g.job = s.job AND g.src = s.src AND g.seq = s.seq
), publishes AS (
    SELECT tr.job, tr.src, tr.seq, tr.trained_version, p.src AS p_src, p.seq AS p_seq,
           row_number() OVER (PARTITION BY tr.job, tr.src, tr.seq, tr.group_id
                              ORDER BY p.t DESC, p.src DESC, p.seq DESC) AS nth
    FROM trained tr
    JOIN group_published p ON p.job = tr.job AND p.group_id = tr.group_id AND p.t <= tr.t
), weighted AS (
    SELECT pu.job, pu.src, pu.seq,
           sum(v.tokens) AS tokens,
           sum((pu.trained_version - v.policy_version) * v.tokens) AS weighted_age
    FROM publishes pu
    JOIN published_tokens v ON v.job = pu.job AND v.src = pu.p_src AND v.seq = pu.p_seq
    WHERE pu.nth = 1 AND v.policy_version >= 0
    GROUP BY pu.job, pu.src, pu.seq
), group_counts AS (
    SELECT job, src, seq, count(*) AS groups FROM trained GROUP BY job, src, seq
)
SELECT s.job, ru.run_no, ru.run_id, s.step, s.t, s.trained_version,
       coalesce(gc.groups, 0) AS groups,
       coalesce(w.tokens, 0) AS tokens,
       CASE WHEN w.tokens > 0 THEN w.weighted_age * 1.0 / w.tokens END AS batch_age,
       s.logged_batch_age
FROM steps s
JOIN runs ru ON ru.job = s.job AND ru.src = s.src AND ru.run = s.run
LEFT JOIN weighted w ON w.job = s.job AND w.src = s.src AND w.seq = s.seq
LEFT JOIN group_counts gc ON gc.job = s.job AND gc.src = s.src AND gc.seq = s.seq
"""

# Name -> SELECT, in the order they must be created (each may use the ones before it).
VIEWS: dict[str, str] = {
    "runs": RUNS,
    "stops": STOPS,
    "group_timeline": GROUP_TIMELINE,
    "thrown_away_attempts": THROWN_AWAY_ATTEMPTS,
    "kept_attempts": KEPT_ATTEMPTS,
    "lost_progress_groups": LOST_PROGRESS_GROUPS,
    "batch_age_steps": BATCH_AGE_STEPS,
}

# Views that `rolloutdb.store.trace.analysis` computes once as tables: a row per run or per
# stop, read many times by every figure (SQLite would recompute them in each subquery).
MATERIALIZED = frozenset({"runs", "stops"})

# --------------------------------------------------------------------------- figures

THROWN_AWAY_PER_STOP = """
-- Figure 1, per stop of the analysed job: attempts abandoned with reason 'restart' and
-- their thrown-away time in total (see thrown_away_attempts), with the stop's downtime
-- and the snapshot the resumed run restored.
SELECT st.stop_no, st.stopped_run, st.resumed_run, st.downtime, st.snapshot_seq, st.cut_time,
       count(a.prompt_id) AS attempts,
       coalesce(sum(a.thrown_away_s), 0.0) AS thrown_away_s
FROM stops st
LEFT JOIN thrown_away_attempts a ON a.job = st.job AND a.stop_no = st.stop_no
WHERE st.job = 'run'
GROUP BY st.stop_no, st.stopped_run, st.resumed_run, st.downtime, st.snapshot_seq, st.cut_time
ORDER BY st.stop_no
"""

THROWN_AWAY_BY_ATTEMPT = """
-- Figure 1, one row per abandoned attempt. committed_at: its latest turn committed by the
-- cut (NULL at group level); thrown_away_s runs from the later of it and dispatched_at.
SELECT stop_no, prompt_id, generation_index, attempt, group_id, dispatched_at, committed_at, cut_time, thrown_away_s
FROM thrown_away_attempts
WHERE job = 'run'
ORDER BY stop_no, prompt_id, generation_index, attempt, group_id
"""

LOST_PROGRESS_PER_STOP = """
-- Figure 2, per stop: the groups running at the stop, how many were matched with the
-- baseline (sealed in both), and their lost progress in total, on average and at most.
SELECT st.stop_no,
       count(g.prompt_id) AS groups_running,
       count(g.lost_s) AS groups_matched,
       sum(g.lost_s) AS lost_s_total,
       avg(g.lost_s) AS lost_s_mean,
       max(g.lost_s) AS lost_s_max
FROM stops st
LEFT JOIN lost_progress_groups g ON g.stop_no = st.stop_no
WHERE st.job = 'run'
GROUP BY st.stop_no
ORDER BY st.stop_no
"""

LOST_PROGRESS_BY_GROUP = """
-- Figure 2, one row per group running at a stop.
SELECT stop_no, prompt_id, occurrence, sealed_effective_t, baseline_sealed_effective_t, lost_s
FROM lost_progress_groups
ORDER BY stop_no, prompt_id, occurrence, group_id
"""

BATCH_AGE_PER_STEP = """
-- Figure 3, one row per train step of the analysed job, in the order they were trained
-- (a step trained again after a stop appears once per run that trained it).
SELECT run_no, step, t, trained_version, groups, tokens, batch_age, logged_batch_age
FROM batch_age_steps
WHERE job = 'run'
ORDER BY t, run_no, step
"""

KEPT_PER_STOP = """
-- Figure 4, what each stop kept, per stop of the analysed job (see kept_attempts):
-- the attempts running at the stop (abandoned with reason 'restart'), the tokens they had
-- decoded, the tokens and turns the resumed run kept of them, the tokens the cut left
-- with a reason and without one (unexplained_tokens: 0 unless recovery lost work
-- silently), the tokens it generates again, and their thrown-away time.
SELECT st.stop_no, st.stopped_run, st.resumed_run, st.cut_time,
       count(k.prompt_id) AS attempts_running,
       coalesce(sum(k.decoded_tokens), 0) AS decoded_tokens,
       coalesce(sum(k.decoded_by_cut), 0) AS decoded_by_cut,
       coalesce(sum(k.kept_tokens), 0) AS kept_tokens,
       coalesce(sum(k.fallback_tokens), 0) AS fallback_tokens,
       sum(k.unexplained_tokens) AS unexplained_tokens,
       coalesce(sum(k.redone_tokens), 0) AS redone_tokens,
       coalesce(sum(k.turns_kept), 0) AS turns_kept,
       coalesce(sum(k.thrown_away_s), 0.0) AS thrown_away_s
FROM stops st
LEFT JOIN kept_attempts k ON k.job = st.job AND k.stop_no = st.stop_no
WHERE st.job = 'run'
GROUP BY st.stop_no, st.stopped_run, st.resumed_run, st.cut_time
ORDER BY st.stop_no
"""

KEPT_BY_ATTEMPT = """
-- Figure 4, one row per attempt running at a stop.
SELECT stop_no, prompt_id, generation_index, attempt, group_id, decoded_tokens, decoded_by_cut, kept_tokens,
       fallback_tokens, unexplained_tokens, redone_tokens, turns_kept, last_committed_turn, thrown_away_s
FROM kept_attempts
WHERE job = 'run'
ORDER BY stop_no, prompt_id, generation_index, attempt, group_id
"""

FALLBACKS_PER_STOP = """
-- Figure 5, per stop and reason: the calls running at the restored cut that it could not
-- save (call_fallback, recorded at the cut's own time, prefix level) and the tokens that
-- cost: each restarts its turn (a restart_only agent server's calls, say, or an engine
-- that cannot continue a setting exactly), except `newer_policy_version`, the tail of a
-- call decoded by weights newer than the cut's anchor (the call continues without it).
SELECT st.stop_no, st.stopped_run, st.resumed_run, st.cut_time, f.reason, count(*) AS calls,
       coalesce(sum(f.tokens), 0) AS tokens
FROM stops st
JOIN call_fallback f ON f.job = st.job AND abs(f.t - st.cut_time) < 1e-6
WHERE st.job = 'run'
GROUP BY st.stop_no, st.stopped_run, st.resumed_run, st.cut_time, f.reason
ORDER BY st.stop_no, f.reason
"""

QUERIES: dict[str, str] = {
    "thrown_away_per_stop": THROWN_AWAY_PER_STOP,
    "thrown_away_by_attempt": THROWN_AWAY_BY_ATTEMPT,
    "lost_progress_per_stop": LOST_PROGRESS_PER_STOP,
    "lost_progress_by_group": LOST_PROGRESS_BY_GROUP,
    "batch_age_per_step": BATCH_AGE_PER_STEP,
    "kept_per_stop": KEPT_PER_STOP,
    "kept_by_attempt": KEPT_BY_ATTEMPT,
    "fallbacks_per_stop": FALLBACKS_PER_STOP,
}
