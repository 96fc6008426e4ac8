// shardledger-go: a small Go client of the shardledger contract, built from proto/ with
// Debian's Go toolchain (examples/go/build.sh). It checks the contract's test vectors,
// encodes events into rows, and runs a night (and every event kind) against a live ledger:
//
//	shardledger-go vectors tests/data/contract_vectors.json
//	shardledger-go rows < events.jsonl    # {"event": ShardEvent JSON, ...} per line
//	shardledger-go night -target 127.0.0.1:50551 -run night-01 -spec night.json -out DIR
//	shardledger-go kinds -target 127.0.0.1:50551 -run kinds-01
//	shardledger-go codecs                 # which gRPC codec can send each kind
//
// Every result is one JSON object per line on stdout; the exit status is 0 when every
// check held.
package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "shardledger.dev/api/shardledger/v1"
)

// protoCodec marshals with the protobuf API v2 runtime the stubs are generated for:
// Debian's grpc (1.33) defaults to github.com/golang/protobuf 1.3, which predates it.
type protoCodec struct{}

func (protoCodec) Marshal(v interface{}) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }
func (protoCodec) Unmarshal(data []byte, v interface{}) error {
	return proto.Unmarshal(data, v.(proto.Message))
}
func (protoCodec) Name() string { return "proto" }

func emit(v map[string]interface{}) {
	line, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	fmt.Println(string(line))
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "shardledger-go: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: shardledger-go vectors FILE | rows | night -target ADDR -run RUN -spec FILE -out DIR" +
			" | kinds -target ADDR -run RUN | codecs")
	}
	switch os.Args[1] {
	case "vectors":
		if len(os.Args) != 3 {
			fail("usage: shardledger-go vectors FILE")
		}
		os.Exit(checkVectors(os.Args[2]))
	case "rows":
		os.Exit(runRows())
	case "night":
		os.Exit(runNight(os.Args[2:]))
	case "kinds":
		os.Exit(runKinds(os.Args[2:]))
	case "codecs":
		os.Exit(runCodecs())
	default:
		fail("unknown command %q", os.Args[1])
	}
}

// --- the test vectors ---------------------------------------------------------

func checkVectors(path string) int {
	raw, err := os.ReadFile(path)
	if err != nil {
		fail("%v", err)
	}
	doc, err := decodeJSON(raw)
	if err != nil {
		fail("%s: %v", path, err)
	}
	v := doc.(map[string]interface{})
	passed, failed := 0, []string{}
	check := func(name string, ok bool, detail string) {
		if ok {
			passed++
		} else {
			failed = append(failed, name+": "+detail)
		}
	}
	for _, c := range v["jcs"].([]interface{}) {
		m := c.(map[string]interface{})
		value, err := decodeJSON([]byte(m["input"].(string)))
		got := []byte(nil)
		if err == nil {
			got, err = canonical(value)
		}
		check("jcs "+m["name"].(string), err == nil && string(got) == m["output"].(string),
			fmt.Sprintf("got %s (%v)", got, err))
	}
	for _, c := range v["jcs_refused"].([]interface{}) {
		m := c.(map[string]interface{})
		value, err := decodeJSON([]byte(m["input"].(string)))
		if err == nil {
			_, err = canonical(value)
		}
		check("refused "+m["name"].(string), err != nil, "was accepted")
	}
	for _, c := range v["shard_ids"].([]interface{}) {
		m := c.(map[string]interface{})
		params, _ := decodeJSON([]byte(m["params"].(string)))
		got, err := shardID(m["input_blake3"].(string), params)
		check("shard id "+m["shard_id"].(string), err == nil && got == m["shard_id"].(string),
			fmt.Sprintf("got %s (%v)", got, err))
	}
	for _, c := range v["plan_events"].([]interface{}) {
		m := c.(map[string]interface{})
		params, _ := decodeJSON([]byte(m["params"].(string)))
		inputBytes, _ := m["input_bytes"].(json.Number).Int64()
		index, _ := m["plan_index"].(json.Number).Int64()
		outputs := []string{}
		for _, o := range m["expected_outputs"].([]interface{}) {
			outputs = append(outputs, o.(string))
		}
		entry := planEntry{
			ShardID: m["shard_id"].(string), InputRef: m["input_ref"].(string),
			InputBytes: inputBytes, InputBlake3: m["input_blake3"].(string), Params: params,
			ExpectedOutputs: outputs, PlanLine: m["plan_line"].(string), PlanIndex: index,
		}
		got, err := planEventID(m["namespace"].(string), m["run_id"].(string), entry)
		check("plan event "+m["event_id"].(string), err == nil && got == m["event_id"].(string),
			fmt.Sprintf("got %s (%v)", got, err))
	}
	for _, c := range v["fingerprint_digests"].([]interface{}) {
		m := c.(map[string]interface{})
		fields := map[string]string{}
		for k, s := range m["fingerprint"].(map[string]interface{}) {
			fields[k] = s.(string)
		}
		got, err := fingerprintDigest(fields)
		legacy := legacyFingerprintDigest(fields)
		check("fingerprint "+m["digest"].(string),
			err == nil && got == m["digest"].(string) && legacy == m["legacy_digest"].(string),
			fmt.Sprintf("got %s, legacy %s (%v)", got, legacy, err))
	}
	prev := make([]byte, 32)
	for _, c := range v["rows"].([]interface{}) {
		m := c.(map[string]interface{})
		content, err := contentJCS(m["content"].(map[string]interface{}))
		seq, _ := m["run_sequence"].(json.Number).Int64()
		receive, _ := m["receive_time_us"].(json.Number).Int64()
		row := encodeRow(content, seq, receive)
		prev = chainHash(prev, row)
		again, backErr := readBack([]byte(m["row"].(string)))
		check(fmt.Sprintf("row %d", seq),
			err == nil && string(row) == m["row"].(string) && hex.EncodeToString(prev) == m["row_hash"].(string) &&
				backErr == nil && again == m["row"].(string),
			fmt.Sprintf("got %s (%v), read back %s (%v)", row, err, again, backErr))
	}
	for _, c := range v["legacy_rows"].([]interface{}) {
		m := c.(map[string]interface{})
		prevHash, _ := hex.DecodeString(m["prev_hash"].(string))
		got := hex.EncodeToString(chainHash(prevHash, []byte(m["row"].(string))))
		check("legacy row", got == m["row_hash"].(string), "got "+got)
	}
	for _, c := range v["event_rows"].([]interface{}) {
		m := c.(map[string]interface{})
		problem := checkEventRow(m)
		check("event row "+m["name"].(string), problem == "", problem)
	}
	emit(map[string]interface{}{"check": "vectors", "passed": passed, "failed": failed})
	if len(failed) > 0 {
		return 1
	}
	return 0
}

// --- a night against a live ledger ----------------------------------------------

// shardSpec is one shard of the night: its input bytes, params, and what happens to it.
type shardSpec struct {
	Input  string          `json:"input"`
	Params json.RawMessage `json:"params"`
	Fate   string          `json:"fate"` // "commit", "fail" (tag data) or "plan" (planned only)
}

// nightSpec is the night: the environment fingerprint its attempts record, and its shards.
type nightSpec struct {
	Fingerprint map[string]string `json:"fingerprint"`
	Shards      []shardSpec       `json:"shards"`
}

func runNight(args []string) int {
	flags := flag.NewFlagSet("night", flag.ExitOnError)
	target := flags.String("target", "127.0.0.1:50551", "ledger address")
	runID := flags.String("run", "", "run id")
	specPath := flags.String("spec", "", "the night: a JSON list of shards")
	outDir := flags.String("out", "", "where the artifacts are written")
	_ = flags.Parse(args)
	if *runID == "" || *specPath == "" || *outDir == "" {
		fail("night needs -run, -spec and -out")
	}
	raw, err := os.ReadFile(*specPath)
	if err != nil {
		fail("%v", err)
	}
	var night nightSpec
	if err := json.Unmarshal(raw, &night); err != nil {
		fail("%s: %v", *specPath, err)
	}
	specs := night.Shards
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, *target, grpc.WithInsecure(), grpc.WithBlock(),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(protoCodec{})))
	if err != nil {
		fail("cannot reach %s: %v", *target, err)
	}
	defer conn.Close()
	ledger := pb.NewLedgerServiceClient(conn)
	ok := true

	// 1. Plan: ids from the contract's rules, so any SDK derives the same ones.
	var plans []*pb.ShardEvent
	var entries []planEntry
	for i, s := range specs {
		params, err := decodeJSON(s.Params)
		if err != nil {
			fail("shard %d params: %v", i, err)
		}
		input := []byte(s.Input)
		digest := blake3Hex(input)
		id, err := shardID(digest, params)
		if err != nil {
			fail("shard %d: %v", i, err)
		}
		entry := planEntry{
			ShardID: id, InputRef: "/in/" + digest[:12], InputBytes: int64(len(input)),
			InputBlake3: digest, Params: params, ExpectedOutputs: []string{"weights"},
			PlanIndex: int64(i),
		}
		eventID, err := planEventID("", *runID, entry)
		if err != nil {
			fail("shard %d: %v", i, err)
		}
		paramsJSON, _ := entry.paramsJSON()
		entries = append(entries, entry)
		plans = append(plans, &pb.ShardEvent{
			EventId: eventID, RunId: *runID, ShardId: id,
			Payload: &pb.ShardEvent_Planned{Planned: &pb.ShardPlanned{
				InputRef: entry.InputRef, InputBytes: entry.InputBytes, InputBlake3: digest,
				ParamsJson: paramsJSON, ExpectedOutputs: entry.ExpectedOutputs, PlanIndex: entry.PlanIndex,
			}},
		})
	}
	planned, err := ledger.AppendEvents(ctx, &pb.AppendEventsRequest{Events: plans})
	if err != nil {
		fail("plan: %v", err)
	}
	for i, r := range planned.GetResults() {
		emit(map[string]interface{}{
			"step": "plan", "shard_id": entries[i].ShardID, "event_id": r.GetEventId(),
			"outcome": r.GetOutcome().String(),
		})
	}

	// 2. The life cycle of every shard that runs here.
	fields := night.Fingerprint
	fpDigest, err := fingerprintDigest(fields)
	if err != nil {
		fail("fingerprint: %v", err)
	}
	var firstStart *pb.ShardEvent
	var firstStartSeq int64
	for i, s := range specs {
		if s.Fate == "plan" {
			continue
		}
		id, attempt := entries[i].ShardID, "go-a0"
		started := &pb.ShardEvent{
			EventId: "go-start-" + *runID + "-" + id, RunId: *runID, ShardId: id, AttemptId: attempt,
			ClientTime: timestamppb.Now(),
			Payload: &pb.ShardEvent_Started{Started: &pb.AttemptStarted{
				Host: "go-host", Pid: int64(os.Getpid()), HeartbeatTimeout: durationpb.New(time.Hour),
				Fingerprint: fields, FingerprintDigest: fpDigest,
			}},
		}
		events := []*pb.ShardEvent{started, {
			EventId: "go-beat-" + *runID + "-" + id, RunId: *runID, ShardId: id, AttemptId: attempt,
			Payload: &pb.ShardEvent_Heartbeat{Heartbeat: &pb.Heartbeat{
				Step: 1, Progress: 1.0, Metrics: map[string]float64{"loss": 1e-7},
			}},
		}}
		if s.Fate == "commit" {
			path, size, digest, err := writeArtifact(*outDir, id)
			if err != nil {
				fail("%v", err)
			}
			events = append(events, &pb.ShardEvent{
				EventId: "go-commit-" + *runID + "-" + id, RunId: *runID, ShardId: id, AttemptId: attempt,
				Payload: &pb.ShardEvent_ArtifactCommitted{ArtifactCommitted: &pb.ArtifactCommitted{
					Name: "weights", Path: path, SizeBytes: size, Blake3Hex: digest,
				}},
			})
		} else {
			events = append(events, &pb.ShardEvent{
				EventId: "go-fail-" + *runID + "-" + id, RunId: *runID, ShardId: id, AttemptId: attempt,
				Payload: &pb.ShardEvent_Failed{Failed: &pb.AttemptFailed{
					Tag: pb.FailureTag_FAILURE_TAG_DATA, Message: "DataError: bad frame",
				}},
			})
		}
		resp, err := ledger.AppendEvents(ctx, &pb.AppendEventsRequest{Events: events})
		if err != nil {
			fail("shard %s: %v", id, err)
		}
		if firstStart == nil {
			firstStart, firstStartSeq = started, resp.GetResults()[0].GetSequence()
		}
		emit(map[string]interface{}{"step": "run", "shard_id": id, "fate": s.Fate, "events": len(events)})
	}

	// 3. Idempotency: the same start, restamped by a retry, is the same event.
	if firstStart != nil {
		firstStart.ClientTime = timestamppb.New(time.Now().Add(time.Minute))
		resp, err := ledger.AppendEvents(ctx, &pb.AppendEventsRequest{Events: []*pb.ShardEvent{firstStart}})
		if err != nil {
			fail("resend: %v", err)
		}
		r := resp.GetResults()[0]
		same := r.GetOutcome() == pb.AppendOutcome_APPEND_OUTCOME_DUPLICATE && r.GetSequence() == firstStartSeq
		ok = ok && same
		emit(map[string]interface{}{
			"step": "resend", "outcome": r.GetOutcome().String(), "sequence": r.GetSequence(),
			"original_sequence": firstStartSeq, "ok": same,
		})
	}

	// 4. The error model: a digest that is not the fingerprint's, decoded from ErrorInfo.
	bad := &pb.ShardEvent{
		EventId: "go-bad-digest-" + *runID, RunId: *runID, ShardId: entries[0].ShardID, AttemptId: "go-a9",
		Payload: &pb.ShardEvent_Started{Started: &pb.AttemptStarted{
			Host: "go-host", Pid: 1, HeartbeatTimeout: durationpb.New(time.Hour),
			Fingerprint: map[string]string{"gpu.0.name": "H100"}, FingerprintDigest: blake3Hex([]byte("wrong")),
		}},
	}
	_, err = ledger.AppendEvents(ctx, &pb.AppendEventsRequest{Events: []*pb.ShardEvent{bad}})
	st, _ := status.FromError(err)
	reason, metadata := "", map[string]string{}
	for _, d := range st.Details() {
		if info, isInfo := d.(*errdetails.ErrorInfo); isInfo {
			reason, metadata = info.GetReason(), info.GetMetadata()
		}
	}
	refused := st.Code() == codes.InvalidArgument && reason == "FINGERPRINT_DIGEST_MISMATCH"
	ok = ok && refused
	emit(map[string]interface{}{
		"step": "error", "code": st.Code().String(), "reason": reason, "metadata": metadata, "ok": refused,
	})
	// 5. A typed read: the run summary as a message, no JSON to parse.
	summary, err := ledger.GetRunSummary(ctx, &pb.GetRunSummaryRequest{RunId: *runID})
	if err != nil {
		fail("summary: %v", err)
	}
	s := summary.GetSummary()
	emit(map[string]interface{}{
		"step": "summary", "submitted": s.GetSubmitted(), "unverified": s.GetUnverified(),
		"failed": s.GetFailed(), "missing": s.GetMissing(), "fingerprint_groups": s.GetFingerprintGroups(),
	})
	if !ok {
		return 1
	}
	return 0
}

// writeArtifact writes an output atomically (temp file, fsync, rename, fsync dir).
func writeArtifact(dir, shard string) (string, int64, string, error) {
	target := filepath.Join(dir, shard, "weights.bin")
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return "", 0, "", err
	}
	data := bytes.Repeat([]byte(shard), 64)
	tmp := target + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return "", 0, "", err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return "", 0, "", err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return "", 0, "", err
	}
	if err := f.Close(); err != nil {
		return "", 0, "", err
	}
	if err := os.Rename(tmp, target); err != nil {
		return "", 0, "", err
	}
	if d, err := os.Open(filepath.Dir(target)); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return target, int64(len(data)), blake3Hex(data), nil
}
