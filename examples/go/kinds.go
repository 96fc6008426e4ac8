// `kinds`: every message kind sent to a live ledger, every optional field set on one of
// them, then the run read back (ListEvents) and each row hash re-derived from the event
// the server returns, by the rules of docs/contract.md.
package main

import (
	"context"
	"encoding/hex"
	"flag"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers grpc's default codec
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "shardledger.dev/api/shardledger/v1"
)

// kindEvents is a run's life in every kind: shard A planned with every field, run by a
// two-rank attempt (scheduler, input seen, coalesced heartbeat, sharded checkpoint,
// an object-store commit, a verdict); shard B planned bare and failed; the run closed,
// reopened, closed and reopened again with every run-level field unset.
func kindEvents(runID string) []*pb.ShardEvent {
	inputA, inputB := []byte("kinds input A: Äpfel 🍎"), []byte("kinds input B")
	digestA, digestB := blake3Hex(inputA), blake3Hex(inputB)
	paramsA, _ := canonical(map[string]interface{}{"frame": int64(0), "lr": 1.0, "seed": "18446744073709551615"})
	shardA, _ := shardID(digestA, map[string]interface{}{"frame": int64(0), "lr": 1.0, "seed": "18446744073709551615"})
	shardB, _ := shardID(digestB, map[string]interface{}{})
	weights := []byte("weights of " + shardA)
	now := time.Now()
	id := func(name string) string { return "go-kinds-" + runID + "-" + name }
	ranked := func(rank, localRank int32) *pb.AttemptStarted {
		return &pb.AttemptStarted{
			Host: "gpu-node-07", Pid: 4194304 + int64(rank), HeartbeatTimeout: durationpb.New(time.Hour + 1500*time.Nanosecond),
			Fingerprint: map[string]string{"schema": "2", "gpu.0.name": "NVIDIA H100 80GB HBM3",
				"gpu.0.uuid": "GPU-0", "host.label": "Zürich-α"},
			Scheduler: &pb.SchedulerIdentity{Kind: "slurm", JobId: "4242", ArrayJobId: "4240",
				ArrayTaskId: "2", Cluster: "night", Node: "gpu-node-07", Namespace: "batch"},
			ProcessStartTicks: 9007199254740993, Labels: map[string]string{"pool": "spot", "image": ""},
			Rank: rank, WorldSize: 2, LocalRank: localRank, LaunchId: "launch-1", RestartCount: 1, GpuCount: 1,
			Input: &pb.InputSeen{InputRef: "/in/kinds-a", SizeBytes: int64(len(inputA)),
				MtimeNs: 1764000000123456789, Inode: 18446744073709551615, Device: 2049,
				VersionId: "v-1", Etag: `"9b2cf535f27731c974343645a3985328"`, Blake3Hex: digestA},
		}
	}
	attempt := func(name, shard, attemptID string) *pb.ShardEvent {
		return &pb.ShardEvent{EventId: id(name), RunId: runID, ShardId: shard, AttemptId: attemptID,
			ClientTime: timestamppb.New(now)}
	}
	with := func(ev *pb.ShardEvent, set func(*pb.ShardEvent)) *pb.ShardEvent { set(ev); return ev }
	return []*pb.ShardEvent{
		with(attempt("plan-a", shardA, ""), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Planned{Planned: &pb.ShardPlanned{
				InputRef: "/in/kinds-a", InputBytes: int64(len(inputA)), InputBlake3: digestA,
				ParamsJson: string(paramsA), ExpectedOutputs: []string{"weights"},
				PlanLine: `{"input": "/in/kinds-a", "shard_id": "` + shardA + `"}`, PlanIndex: 0,
				Labels:         map[string]string{"provider": "onprem", "region": "eu-zürich"},
				InputVersionId: "v-1", InputEtag: `"9b2cf535f27731c974343645a3985328"`,
				InputMtimeNs: 1764000000123456789, InputInode: 18446744073709551615, InputDevice: 2049,
			}}
		}),
		with(attempt("plan-b", shardB, ""), func(ev *pb.ShardEvent) {
			ev.ClientTime = nil
			ev.Payload = &pb.ShardEvent_Planned{Planned: &pb.ShardPlanned{
				InputRef: "/in/kinds-b", InputBytes: int64(len(inputB)), InputBlake3: digestB, PlanIndex: 1,
			}}
		}),
		with(attempt("start-a0", shardA, "a0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Started{Started: ranked(0, 0)}
		}),
		with(attempt("start-a1", shardA, "a0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Started{Started: ranked(1, 1)}
		}),
		with(attempt("beat-a1", shardA, "a0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Heartbeat{Heartbeat: &pb.Heartbeat{
				Step: 20, Progress: 0.5, Metrics: map[string]float64{"loss": 1e-7, "tokens/s": 1e21},
				NonfiniteMetrics: []string{"grad_norm"}, Rank: 1, FirstStep: 11,
				MetricsMin: map[string]float64{"loss": 1e-8}, MetricsMax: map[string]float64{"loss": 2.5},
				ProgressCalls: 10,
			}}
		}),
		with(attempt("ckpt-a0", shardA, "a0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Checkpoint{Checkpoint: &pb.CheckpointSaved{
				Step: 20, Path: "/ckpt/a/20.rank0", SizeBytes: 9007199254740993, Blake3Hex: blake3Hex([]byte("c0")),
				WriteDuration: durationpb.New(12345678901 * time.Nanosecond), WorldSize: 2,
			}}
		}),
		with(attempt("ckpt-a1", shardA, "a0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Checkpoint{Checkpoint: &pb.CheckpointSaved{
				Step: 20, Path: "/ckpt/a/20.rank1", SizeBytes: 7, Blake3Hex: blake3Hex([]byte("c1")),
				Rank: 1, WorldSize: 2,
			}}
		}),
		with(attempt("commit-a", shardA, "a0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_ArtifactCommitted{ArtifactCommitted: &pb.ArtifactCommitted{
				Name: "weights", Path: "s3://bucket/kinds/weights.bin", SizeBytes: int64(len(weights)),
				Blake3Hex: blake3Hex(weights), MediaType: "application/octet-stream", Rank: 1,
				VersionId: "v-7", Etag: `"e-7"`, ReadBack: "digest",
			}}
		}),
		with(attempt("done-a1", shardA, "a0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Heartbeat{Heartbeat: &pb.Heartbeat{
				Step: 21, Progress: 1, Rank: 1, RankFinished: true,
			}}
		}),
		with(attempt("verify-a", shardA, "a0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Verified{Verified: &pb.ArtifactVerified{
				Name: "weights", Path: "s3://bucket/kinds/weights.bin", Blake3Hex: blake3Hex(weights),
				Result: pb.VerificationResult_VERIFICATION_RESULT_PASSED, Detail: "re-read: 1 object", VersionId: "v-7",
			}}
		}),
		with(attempt("start-b", shardB, "b0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Started{Started: &pb.AttemptStarted{
				Host: "cpu-1", Pid: 7, HeartbeatTimeout: durationpb.New(time.Minute),
			}}
		}),
		with(attempt("fail-b", shardB, "b0"), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_Failed{Failed: &pb.AttemptFailed{
				Tag: pb.FailureTag_FAILURE_TAG_OOM, Message: "CUDA out of memory\n\"tried\" 2 GiB",
				DiagnosticsPath: "/diag/b0.tar", DiagnosticsBlake3Hex: blake3Hex([]byte("diag")),
			}}
		}),
		with(attempt("close-1", "", ""), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_SubmissionClosed{SubmissionClosed: &pb.RunSubmissionClosed{
				Reason: "last wave", ExpectedShards: 2, SubmittedUntil: timestamppb.New(now),
			}}
		}),
		with(attempt("reopen-1", "", ""), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_RunReopened{RunReopened: &pb.RunReopened{Reason: "a late wave"}}
		}),
		// Every run-level field unset: the payload is {}. The wrapper holds an empty
		// message, never a nil one (a nil message in a oneof is not an event; see README).
		with(attempt("close-2", "", ""), func(ev *pb.ShardEvent) {
			ev.Payload = &pb.ShardEvent_SubmissionClosed{SubmissionClosed: &pb.RunSubmissionClosed{}}
		}),
		with(attempt("reopen-2", "", ""), func(ev *pb.ShardEvent) {
			ev.ClientTime = nil
			ev.Payload = &pb.ShardEvent_RunReopened{RunReopened: &pb.RunReopened{}}
		}),
	}
}

func runKinds(args []string) int {
	flags := flag.NewFlagSet("kinds", flag.ExitOnError)
	target := flags.String("target", "127.0.0.1:50551", "ledger address")
	runID := flags.String("run", "", "run id")
	_ = flags.Parse(args)
	if *runID == "" {
		fail("kinds needs -run")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, *target, grpc.WithInsecure(), grpc.WithBlock(),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(protoCodec{})))
	if err != nil {
		fail("cannot reach %s: %v", *target, err)
	}
	defer conn.Close()
	ledger := pb.NewLedgerServiceClient(conn)
	sent := map[string]int{}
	for _, ev := range kindEvents(*runID) {
		resp, err := ledger.AppendEvents(ctx, &pb.AppendEventsRequest{Events: []*pb.ShardEvent{ev}})
		if err != nil {
			fail("%s: %v", ev.GetEventId(), err)
		}
		fd, _ := payloadField(ev)
		sent[string(fd.Name())]++
		r := resp.GetResults()[0]
		emit(map[string]interface{}{"step": "append", "event_id": r.GetEventId(),
			"outcome": r.GetOutcome().String(), "input_changed": r.GetInputChanged()})
	}

	// The run read back: each row re-derived from the event as ListEvents returns it.
	prev, rows, ok, token := make([]byte, 32), 0, true, ""
	for {
		page, err := ledger.ListEvents(ctx, &pb.ListEventsRequest{RunId: *runID, PageSize: 100, PageToken: token})
		if err != nil {
			fail("list: %v", err)
		}
		for _, ev := range page.GetEvents() {
			content, err := eventContent(ev)
			text := []byte(nil)
			if err == nil {
				text, err = canonical(content)
			}
			receiveUs := ev.GetReceiveTime().AsTime().UnixMicro()
			row := encodeRow(text, ev.GetRunSequence(), receiveUs)
			prev = chainHash(prev, row)
			same := err == nil && ev.GetRowFormat() == 2 && hex.EncodeToString(prev) == hex.EncodeToString(ev.GetRowHash())
			if !same {
				ok = false
				emit(map[string]interface{}{"step": "row", "run_sequence": ev.GetRunSequence(),
					"row": string(row), "error": errText(err), "row_format": ev.GetRowFormat()})
				prev = ev.GetRowHash()
			}
			rows++
		}
		if token = page.GetNextPageToken(); token == "" {
			break
		}
	}
	emit(map[string]interface{}{"step": "kinds", "sent": sent, "rows_verified": rows, "ok": ok})
	if !ok {
		return 1
	}
	return 0
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// runCodecs marshals an AppendEventsRequest of every kind, and unmarshals a
// ListEventsResponse, with grpc's default codec and with protoCodec, and says which
// panic or fail. grpc 1.33's default codec is github.com/golang/protobuf's; before 1.4
// (Debian's golang-github-golang-protobuf-1-3-dev) it cannot walk the oneof of a
// message generated for the protobuf API v2 and panics with a nil pointer.
func runCodecs() int {
	codecs := map[string]encoding.Codec{"default": encoding.GetCodec("proto"), "forced": protoCodec{}}
	try := func(f func() error) (result string) {
		defer func() {
			if r := recover(); r != nil {
				result = fmt.Sprintf("panic: %v", r)
			}
		}()
		if err := f(); err != nil {
			return "error: " + err.Error()
		}
		return "ok"
	}
	ok := true
	events := kindEvents("codecs")
	for _, name := range []string{"default", "forced"} {
		codec := codecs[name]
		results := map[string]string{}
		for _, ev := range events {
			fd, _ := payloadField(ev)
			request := &pb.AppendEventsRequest{Events: []*pb.ShardEvent{ev}}
			results[string(fd.Name())] = try(func() error {
				data, err := codec.Marshal(request)
				if err != nil {
					return err
				}
				return codec.Unmarshal(data, &pb.AppendEventsRequest{})
			})
		}
		results["GetRunSummaryRequest"] = try(func() error {
			_, err := codec.Marshal(&pb.GetRunSummaryRequest{RunId: "codecs"})
			return err
		})
		for _, result := range results {
			ok = ok && (name == "default" || result == "ok")
		}
		emit(map[string]interface{}{"step": "codec", "codec": name, "results": results})
	}
	if !ok {
		return 1
	}
	return 0
}
