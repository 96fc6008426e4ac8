// Rows from events, two ways: the event-row vectors (every kind, every field unset and
// set) and `rows`, which encodes events read from stdin, for a differential test
// against the Python implementation (tests/contract/test_go_client.py).
package main

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "shardledger.dev/api/shardledger/v1"
)

// eventOf reads a ShardEvent from its protobuf JSON form.
func eventOf(text []byte) (*pb.ShardEvent, error) {
	ev := &pb.ShardEvent{}
	if err := protojson.Unmarshal(text, ev); err != nil {
		return nil, err
	}
	return ev, nil
}

// jsonText is a value decoded by decodeJSON written back as JSON (numbers as their literals).
func jsonText(v interface{}) []byte {
	text, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return text
}

// checkEventRow checks one event-row vector: the event as sent encodes to the row and
// its hash, and the row reads back into the event the ledger stores (ListEvents' form),
// which encodes to the same row again. It returns what differed, or "".
func checkEventRow(m map[string]interface{}) string {
	sent, err := eventOf(jsonText(m["event"]))
	if err != nil {
		return fmt.Sprintf("event: %v", err)
	}
	stored, err := eventOf(jsonText(m["stored"]))
	if err != nil {
		return fmt.Sprintf("stored: %v", err)
	}
	seq, _ := intOf(m["run_sequence"], 64)
	receive, _ := intOf(m["receive_time_us"], 64)
	prev, _ := hex.DecodeString(m["prev_hash"].(string))
	content, row, err := eventRow(sent, seq, receive)
	switch {
	case err != nil:
		return err.Error()
	case string(content) != m["content_canonical"].(string):
		return "content " + string(content)
	case string(row) != m["row"].(string):
		return "row " + string(row)
	case hex.EncodeToString(chainHash(prev, row)) != m["row_hash"].(string):
		return "row hash " + hex.EncodeToString(chainHash(prev, row))
	}
	decoded, dseq, dreceive, err := decodeRow(row)
	if err != nil {
		return "read back: " + err.Error()
	}
	if !proto.Equal(decoded, stored) {
		return "read back: " + protojson.Format(decoded)
	}
	again, err := eventContent(decoded)
	if err != nil {
		return "read back: " + err.Error()
	}
	text, err := canonical(again)
	if err != nil || !bytes.Equal(encodeRow(text, dseq, dreceive), row) {
		return fmt.Sprintf("read back re-encodes as %s (%v)", text, err)
	}
	return ""
}

// rowRequest is one line of `rows` input.
type rowRequest struct {
	Event         json.RawMessage `json:"event"` // a ShardEvent in protobuf JSON, as sent
	RunSequence   int64           `json:"run_sequence"`
	ReceiveTimeUs int64           `json:"receive_time_us"`
	PrevHash      string          `json:"prev_hash"` // hex; empty: the genesis hash
}

func rowOf(line []byte) map[string]interface{} {
	var req rowRequest
	if err := json.Unmarshal(line, &req); err != nil {
		return map[string]interface{}{"error": err.Error()}
	}
	ev, err := eventOf(req.Event)
	if err != nil {
		return map[string]interface{}{"error": err.Error()}
	}
	prev := make([]byte, 32)
	if req.PrevHash != "" {
		if prev, err = hex.DecodeString(req.PrevHash); err != nil || len(prev) != 32 {
			return map[string]interface{}{"error": "prev_hash is not 32 bytes of hex"}
		}
	}
	content, row, err := eventRow(ev, req.RunSequence, req.ReceiveTimeUs)
	if err != nil {
		return map[string]interface{}{"error": err.Error()}
	}
	again, err := readBack(row)
	if err != nil {
		again = "error: " + err.Error()
	}
	return map[string]interface{}{
		"content": string(content), "row": string(row),
		"row_hash": hex.EncodeToString(chainHash(prev, row)), "read_back": again,
	}
}

// readBack is a row of format 2 decoded into its event and encoded again: the row itself.
func readBack(row []byte) (string, error) {
	ev, seq, receive, err := decodeRow(row)
	if err != nil {
		return "", err
	}
	content, err := eventContent(ev)
	if err != nil {
		return "", err
	}
	text, err := canonical(content)
	if err != nil {
		return "", err
	}
	return string(encodeRow(text, seq, receive)), nil
}

// runRows answers each line of stdin, {"event": ..., "run_sequence": N,
// "receive_time_us": N, "prev_hash": HEX}, with one line: {"content", "row",
// "row_hash", "read_back"} (the row decoded and encoded again) or {"error"}. Each answer is flushed at once, so a caller may hold
// one process open and ask line by line.
func runRows() int {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 0, 1<<20), 64<<20)
	out := bufio.NewWriter(os.Stdout)
	for in.Scan() {
		if len(bytes.TrimSpace(in.Bytes())) == 0 {
			continue
		}
		out.Write(jsonText(rowOf(in.Bytes())))
		out.WriteByte('\n')
		if err := out.Flush(); err != nil {
			return 1
		}
	}
	if err := in.Err(); err != nil {
		fail("stdin: %v", err)
	}
	return 0
}
