// An event's canonical content (docs/contract.md, "Every field of every event"): a
// ShardEvent as the ledger hashes it, and a stored row read back into a ShardEvent.
// Both directions walk the proto descriptors with the page's rules, so a field the
// rules do not cover is an error here rather than a silently different row.
package main

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "shardledger.dev/api/shardledger/v1"
)

// firstVersion names, per payload message, the fields of the first contract version:
// every row has them, set or not. Every other field (all added later, and any added in
// future) is left out while unset: "", 0, false, an empty map or list, an unset message.
var firstVersion = map[protoreflect.Name][]protoreflect.Name{
	"ShardPlanned": {"input_ref", "input_bytes", "input_blake3", "params_json",
		"expected_outputs", "plan_line", "plan_index"},
	"AttemptStarted":      {"host", "pid", "heartbeat_timeout", "fingerprint", "fingerprint_digest"},
	"Heartbeat":           {"step", "progress", "metrics"},
	"CheckpointSaved":     {"step", "path", "size_bytes", "blake3_hex"},
	"ArtifactCommitted":   {"name", "path", "size_bytes", "blake3_hex", "media_type"},
	"ArtifactVerified":    {"name", "path", "blake3_hex", "result", "reason", "detail"},
	"AttemptFailed":       {"tag", "message"},
	"RunSubmissionClosed": {},
	"RunReopened":         {},
}

// inputKeys: AttemptStarted.input (InputSeen) is flattened into the started payload.
var inputKeys = map[protoreflect.Name]string{
	"input_ref": "input_ref", "size_bytes": "input_bytes", "mtime_ns": "input_mtime_ns",
	"inode": "input_inode", "device": "input_device", "version_id": "input_version_id",
	"etag": "input_etag", "blake3_hex": "input_blake3",
}

const (
	timestampName protoreflect.FullName = "google.protobuf.Timestamp"
	durationName  protoreflect.FullName = "google.protobuf.Duration"
	schedulerName protoreflect.FullName = "shardledger.v1.SchedulerIdentity"
	inputSeenName protoreflect.FullName = "shardledger.v1.InputSeen"
	// The last microsecond a Timestamp holds: 9999-12-31T23:59:59.999999Z.
	maxTimestampUs = 253402300799999999
)

// rowKey is a field's key in the row: its proto name, a Timestamp or Duration NAME as
// NAME_us, except CheckpointSaved.write_duration, which is write_us.
func rowKey(fd protoreflect.FieldDescriptor) string {
	if fd.FullName() == "shardledger.v1.CheckpointSaved.write_duration" {
		return "write_us"
	}
	if m := fd.Message(); m != nil && !fd.IsMap() &&
		(m.FullName() == timestampName || m.FullName() == durationName) {
		return string(fd.Name()) + "_us"
	}
	return string(fd.Name())
}

// safeInt is an integer as a row holds it: a number, a decimal string past 2^53 - 1.
func safeInt(n int64) interface{} {
	if n > maxSafeInteger || n < -maxSafeInteger {
		return strconv.FormatInt(n, 10)
	}
	return n
}

func safeUint(n uint64) interface{} {
	if n > maxSafeInteger {
		return strconv.FormatUint(n, 10)
	}
	return int64(n)
}

// floorDiv is Python's //: a negative nanos count rounds down, as the server's does.
func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}

// micros is a Timestamp or Duration in microseconds, sub-microsecond digits dropped
// (rounded down, as the ledger does). Before 1970, after 9999 or negative is refused.
func micros(m protoreflect.Message) (int64, error) {
	fields := m.Descriptor().Fields()
	seconds := m.Get(fields.ByName("seconds")).Int()
	nanos := m.Get(fields.ByName("nanos")).Int()
	low := int64(0)
	if m.Descriptor().FullName() == durationName {
		low = -999_999_999
	}
	if nanos < low || nanos > 999_999_999 || seconds < 0 || seconds > maxTimestampUs/1_000_000 {
		return 0, fmt.Errorf("%s %ds %dns is outside [0, year 10000)", m.Descriptor().Name(), seconds, nanos)
	}
	us := seconds*1_000_000 + floorDiv(nanos, 1000)
	if us < 0 || us > maxTimestampUs {
		return 0, fmt.Errorf("%s %ds %dns is outside [0, year 10000)", m.Descriptor().Name(), seconds, nanos)
	}
	return us, nil
}

// enumName is a value's name without its enum's prefix, lowercased: FAILURE_TAG_OOM -> oom.
func enumName(ed protoreflect.EnumDescriptor, n protoreflect.EnumNumber) (string, error) {
	value := ed.Values().ByNumber(n)
	if n == 0 || value == nil {
		return "", fmt.Errorf("%s %d is not a value the ledger takes", ed.Name(), n)
	}
	return strings.ToLower(strings.TrimPrefix(string(value.Name()), enumPrefix(ed))), nil
}

// enumPrefix is the enum's name in UPPER_SNAKE_CASE and "_": FailureTag -> FAILURE_TAG_.
func enumPrefix(ed protoreflect.EnumDescriptor) string {
	var b strings.Builder
	for i, r := range string(ed.Name()) {
		if i > 0 && unicode.IsUpper(r) {
			b.WriteByte('_')
		}
		b.WriteRune(unicode.ToUpper(r))
	}
	return b.String() + "_"
}

// scalar is a singular non-message field's JSON value and whether it is set.
func scalar(fd protoreflect.FieldDescriptor, v protoreflect.Value) (interface{}, bool, error) {
	switch fd.Kind() {
	case protoreflect.StringKind:
		return v.String(), v.String() != "", nil
	case protoreflect.BoolKind:
		return v.Bool(), v.Bool(), nil
	case protoreflect.Int32Kind, protoreflect.Int64Kind:
		return safeInt(v.Int()), v.Int() != 0, nil
	case protoreflect.Uint32Kind, protoreflect.Uint64Kind:
		return safeUint(v.Uint()), v.Uint() != 0, nil
	case protoreflect.DoubleKind:
		return v.Float(), v.Float() != 0, nil
	case protoreflect.EnumKind:
		name, err := enumName(fd.Enum(), v.Enum())
		return name, true, err
	}
	return nil, false, fmt.Errorf("%s: no rule for a %s field", fd.FullName(), fd.Kind())
}

// fieldValue is a field's key in the row, its JSON value and whether it is set.
func fieldValue(m protoreflect.Message, fd protoreflect.FieldDescriptor) (string, interface{}, bool, error) {
	v := m.Get(fd)
	key := rowKey(fd)
	switch {
	case fd.IsMap():
		out := map[string]interface{}{}
		var err error
		v.Map().Range(func(k protoreflect.MapKey, item protoreflect.Value) bool {
			var value interface{}
			value, _, err = scalar(fd.MapValue(), item)
			out[k.String()] = value
			return err == nil
		})
		return key, out, len(out) > 0, err
	case fd.IsList():
		out := []interface{}{}
		for i := 0; i < v.List().Len(); i++ {
			item, _, err := scalar(fd, v.List().Get(i))
			if err != nil {
				return key, nil, false, err
			}
			out = append(out, item)
		}
		return key, out, len(out) > 0, nil
	case fd.Message() != nil:
		switch fd.Message().FullName() {
		case timestampName, durationName:
			if !m.Has(fd) {
				return key, int64(0), false, nil
			}
			us, err := micros(v.Message())
			return key, safeInt(us), us != 0, err
		case schedulerName:
			// The set fields of the scheduler identity, by their proto names.
			out := map[string]interface{}{}
			if m.Has(fd) {
				sub := v.Message()
				fields := sub.Descriptor().Fields()
				for i := 0; i < fields.Len(); i++ {
					if s := sub.Get(fields.Get(i)).String(); s != "" {
						out[string(fields.Get(i).Name())] = s
					}
				}
			}
			return key, out, len(out) > 0, nil
		}
		return key, nil, false, fmt.Errorf("%s: no rule for a %s field", fd.FullName(), fd.Message().FullName())
	}
	value, set, err := scalar(fd, v)
	return key, value, set, err
}

// payloadContent is a payload message's fields as the row holds them.
func payloadContent(m protoreflect.Message) (map[string]interface{}, error) {
	first, known := firstVersion[m.Descriptor().Name()]
	if !known {
		return nil, fmt.Errorf("no rule for payload %s", m.Descriptor().FullName())
	}
	always := map[protoreflect.Name]bool{}
	for _, name := range first {
		always[name] = true
	}
	out := map[string]interface{}{}
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if fd.Message() != nil && fd.Message().FullName() == inputSeenName {
			if err := flattenInput(m, fd, out); err != nil {
				return nil, err
			}
			continue
		}
		key, value, set, err := fieldValue(m, fd)
		if err != nil {
			return nil, err
		}
		if set || always[fd.Name()] {
			out[key] = value
		}
	}
	return out, nil
}

// flattenInput writes the set fields of AttemptStarted.input as input_* keys.
func flattenInput(m protoreflect.Message, fd protoreflect.FieldDescriptor, out map[string]interface{}) error {
	if !m.Has(fd) {
		return nil
	}
	seen := m.Get(fd).Message()
	fields := seen.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		sf := fields.Get(i)
		key, known := inputKeys[sf.Name()]
		if !known {
			return fmt.Errorf("%s: no rule for it in the started payload", sf.FullName())
		}
		value, set, err := scalar(sf, seen.Get(sf))
		if err != nil {
			return err
		}
		if set {
			out[key] = value
		}
	}
	return nil
}

func payloadField(ev *pb.ShardEvent) (protoreflect.FieldDescriptor, error) {
	m := ev.ProtoReflect()
	fd := m.WhichOneof(m.Descriptor().Oneofs().ByName("payload"))
	if fd == nil {
		return nil, fmt.Errorf("exactly one payload kind must be set")
	}
	return fd, nil
}

// eventContent is the content of a stored (normalized) event: the object its row holds.
// The event kind is the name of the payload's oneof field (submission_closed, not
// RunSubmissionClosed).
func eventContent(ev *pb.ShardEvent) (map[string]interface{}, error) {
	fd, err := payloadField(ev)
	if err != nil {
		return nil, err
	}
	payload, err := payloadContent(ev.ProtoReflect().Get(fd).Message())
	if err != nil {
		return nil, err
	}
	clientUs := int64(0)
	if ev.ClientTime != nil {
		if clientUs, err = micros(ev.ClientTime.ProtoReflect()); err != nil {
			return nil, err
		}
	}
	return map[string]interface{}{
		"event_id": ev.GetEventId(), "namespace": ev.GetNamespace(), "run_id": ev.GetRunId(),
		"shard_id": ev.GetShardId(), "attempt_id": ev.GetAttemptId(),
		"client_time_us": safeInt(clientUs), "kind": string(fd.Name()), "payload": payload,
	}, nil
}

// canonicalObject is a JSON object text in RFC 8785 form ("" stays empty).
func canonicalObject(field, text, empty string) (string, error) {
	if text == "" {
		return empty, nil
	}
	value, err := decodeJSON([]byte(text))
	if err != nil {
		return "", fmt.Errorf("%s is not valid JSON: %v", field, err)
	}
	if _, isObject := value.(map[string]interface{}); !isObject {
		return "", fmt.Errorf("%s must be a JSON object", field)
	}
	out, err := canonical(value)
	return string(out), err
}

// normalize is the event as the ledger stores it: the namespace defaulted, params_json
// and plan_line in RFC 8785 form (params_json "{}" when empty), the fingerprint digest
// the ledger's (a legacy digest is replaced, any other is refused).
func normalize(ev *pb.ShardEvent) (*pb.ShardEvent, error) {
	out := proto.Clone(ev).(*pb.ShardEvent)
	if out.Namespace == "" {
		out.Namespace = "default"
	}
	var err error
	switch p := out.Payload.(type) {
	case *pb.ShardEvent_Planned:
		if p.Planned == nil {
			p.Planned = &pb.ShardPlanned{}
		}
		if p.Planned.ParamsJson, err = canonicalObject("params_json", p.Planned.ParamsJson, "{}"); err != nil {
			return nil, err
		}
		if p.Planned.PlanLine, err = canonicalObject("plan_line", p.Planned.PlanLine, ""); err != nil {
			return nil, err
		}
	case *pb.ShardEvent_Started:
		if p.Started == nil || len(p.Started.Fingerprint) == 0 {
			break // a digest sent without a map is the client's group key, kept as sent
		}
		digest, err := fingerprintDigest(p.Started.Fingerprint)
		if err != nil {
			return nil, err
		}
		sent := p.Started.FingerprintDigest
		if sent != "" && sent != digest && sent != legacyFingerprintDigest(p.Started.Fingerprint) {
			return nil, fmt.Errorf("FINGERPRINT_DIGEST_MISMATCH: sent %s, computed %s", sent, digest)
		}
		p.Started.FingerprintDigest = digest
	}
	return out, nil
}

// eventRow is the row of format 2 an event sent as ev is stored as, and its content.
func eventRow(ev *pb.ShardEvent, runSequence, receiveTimeUs int64) ([]byte, []byte, error) {
	stored, err := normalize(ev)
	if err != nil {
		return nil, nil, err
	}
	content, err := eventContent(stored)
	if err != nil {
		return nil, nil, err
	}
	text, err := canonical(content)
	if err != nil {
		return nil, nil, err
	}
	return text, encodeRow(text, runSequence, receiveTimeUs), nil
}

// --- a row read back ------------------------------------------------------------

func intOf(v interface{}, bits int) (int64, error) {
	switch x := v.(type) {
	case json.Number:
		return strconv.ParseInt(string(x), 10, bits)
	case string: // past 2^53 - 1
		return strconv.ParseInt(x, 10, bits)
	}
	return 0, fmt.Errorf("%v is not an integer", v)
}

func uintOf(v interface{}, bits int) (uint64, error) {
	switch x := v.(type) {
	case json.Number:
		return strconv.ParseUint(string(x), 10, bits)
	case string:
		return strconv.ParseUint(x, 10, bits)
	}
	return 0, fmt.Errorf("%v is not an unsigned integer", v)
}

// scalarValue is the protobuf value of a singular non-message field's JSON value.
func scalarValue(fd protoreflect.FieldDescriptor, v interface{}) (protoreflect.Value, error) {
	switch fd.Kind() {
	case protoreflect.StringKind:
		if s, ok := v.(string); ok {
			return protoreflect.ValueOfString(s), nil
		}
	case protoreflect.BoolKind:
		if b, ok := v.(bool); ok {
			return protoreflect.ValueOfBool(b), nil
		}
	case protoreflect.Int32Kind:
		n, err := intOf(v, 32)
		return protoreflect.ValueOfInt32(int32(n)), err
	case protoreflect.Int64Kind:
		n, err := intOf(v, 64)
		return protoreflect.ValueOfInt64(n), err
	case protoreflect.Uint32Kind:
		n, err := uintOf(v, 32)
		return protoreflect.ValueOfUint32(uint32(n)), err
	case protoreflect.Uint64Kind:
		n, err := uintOf(v, 64)
		return protoreflect.ValueOfUint64(n), err
	case protoreflect.DoubleKind:
		if n, ok := v.(json.Number); ok {
			f, err := strconv.ParseFloat(string(n), 64)
			return protoreflect.ValueOfFloat64(f), err
		}
	case protoreflect.EnumKind:
		if s, ok := v.(string); ok {
			value := fd.Enum().Values().ByName(protoreflect.Name(enumPrefix(fd.Enum()) + strings.ToUpper(s)))
			if value != nil && value.Number() != 0 {
				return protoreflect.ValueOfEnum(value.Number()), nil
			}
		}
	}
	return protoreflect.Value{}, fmt.Errorf("%s: %v is not a %s", fd.FullName(), v, fd.Kind())
}

func usMessage(fd protoreflect.FieldDescriptor, us int64) protoreflect.Value {
	seconds, nanos := floorDiv(us, 1_000_000), int32((us-floorDiv(us, 1_000_000)*1_000_000)*1000)
	if fd.Message().FullName() == timestampName {
		return protoreflect.ValueOfMessage((&timestamppb.Timestamp{Seconds: seconds, Nanos: nanos}).ProtoReflect())
	}
	return protoreflect.ValueOfMessage((&durationpb.Duration{Seconds: seconds, Nanos: nanos}).ProtoReflect())
}

// setField sets a field of m from its JSON value in a row.
func setField(m protoreflect.Message, fd protoreflect.FieldDescriptor, v interface{}) error {
	switch {
	case fd.IsMap():
		items, ok := v.(map[string]interface{})
		if !ok {
			return fmt.Errorf("%s: not an object", fd.FullName())
		}
		target := m.Mutable(fd).Map()
		for k, item := range items {
			value, err := scalarValue(fd.MapValue(), item)
			if err != nil {
				return err
			}
			target.Set(protoreflect.ValueOfString(k).MapKey(), value)
		}
	case fd.IsList():
		items, ok := v.([]interface{})
		if !ok {
			return fmt.Errorf("%s: not an array", fd.FullName())
		}
		target := m.Mutable(fd).List()
		for _, item := range items {
			value, err := scalarValue(fd, item)
			if err != nil {
				return err
			}
			target.Append(value)
		}
	case fd.Message() != nil && fd.Message().FullName() == schedulerName:
		items, ok := v.(map[string]interface{})
		if !ok {
			return fmt.Errorf("%s: not an object", fd.FullName())
		}
		sub := m.Mutable(fd).Message()
		for k, item := range items {
			sf := sub.Descriptor().Fields().ByName(protoreflect.Name(k))
			if sf == nil {
				return fmt.Errorf("%s: unknown field %q", fd.FullName(), k)
			}
			value, err := scalarValue(sf, item)
			if err != nil {
				return err
			}
			sub.Set(sf, value)
		}
	case fd.Message() != nil:
		us, err := intOf(v, 64)
		if err != nil {
			return fmt.Errorf("%s: %v", fd.FullName(), err)
		}
		m.Set(fd, usMessage(fd, us))
	default:
		value, err := scalarValue(fd, v)
		if err != nil {
			return err
		}
		m.Set(fd, value)
	}
	return nil
}

// setPayload fills a payload message from the payload object of a row.
func setPayload(m protoreflect.Message, data map[string]interface{}) error {
	used := map[string]bool{}
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if fd.Message() != nil && fd.Message().FullName() == inputSeenName {
			if ref, _ := data["input_ref"].(string); ref == "" {
				continue // no input named: no InputSeen (and no input_* keys may be there)
			}
			seen := m.Mutable(fd).Message()
			sub := seen.Descriptor().Fields()
			for j := 0; j < sub.Len(); j++ {
				key := inputKeys[sub.Get(j).Name()]
				if v, present := data[key]; present {
					used[key] = true
					value, err := scalarValue(sub.Get(j), v)
					if err != nil {
						return err
					}
					seen.Set(sub.Get(j), value)
				}
			}
			continue
		}
		key := rowKey(fd)
		v, present := data[key]
		if !present {
			continue
		}
		used[key] = true
		if err := setField(m, fd, v); err != nil {
			return err
		}
	}
	for key := range data {
		if !used[key] {
			return fmt.Errorf("%s: unknown field %q (a newer contract?)", m.Descriptor().Name(), key)
		}
	}
	return nil
}

// decodeRow reads a row of format 2 back into the event it stores and its place in the
// run. Format 1 rows are verified by their bytes only; any other "v" is not a row.
func decodeRow(row []byte) (*pb.ShardEvent, int64, int64, error) {
	parsed, err := decodeJSON(row)
	if err != nil {
		return nil, 0, 0, err
	}
	outer, ok := parsed.(map[string]interface{})
	if !ok || len(outer) != 4 {
		return nil, 0, 0, fmt.Errorf("a row of format 2 is an object of four keys")
	}
	if v, _ := outer["v"].(json.Number); v != "2" {
		return nil, 0, 0, fmt.Errorf("unknown row format %v", outer["v"])
	}
	runSequence, err := intOf(outer["run_sequence"], 64)
	if err != nil {
		return nil, 0, 0, err
	}
	receiveUs, err := intOf(outer["receive_time_us"], 64)
	if err != nil {
		return nil, 0, 0, err
	}
	data, ok := outer["event"].(map[string]interface{})
	if !ok || len(data) != 8 {
		return nil, 0, 0, fmt.Errorf("a row's event is an object of eight keys")
	}
	text := func(key string) string { s, _ := data[key].(string); return s }
	ev := &pb.ShardEvent{
		EventId: text("event_id"), Namespace: text("namespace"), RunId: text("run_id"),
		ShardId: text("shard_id"), AttemptId: text("attempt_id"),
	}
	clientUs, err := intOf(data["client_time_us"], 64)
	if err != nil {
		return nil, 0, 0, err
	}
	if clientUs != 0 {
		ev.ClientTime = &timestamppb.Timestamp{Seconds: clientUs / 1_000_000, Nanos: int32(clientUs%1_000_000) * 1000}
	}
	m := ev.ProtoReflect()
	fd := m.Descriptor().Oneofs().ByName("payload").Fields().ByName(protoreflect.Name(text("kind")))
	if fd == nil {
		return nil, 0, 0, fmt.Errorf("unknown event kind %q", text("kind"))
	}
	payload, ok := data["payload"].(map[string]interface{})
	if !ok {
		return nil, 0, 0, fmt.Errorf("a row's payload is an object")
	}
	if err := setPayload(m.Mutable(fd).Message(), payload); err != nil {
		return nil, 0, 0, err
	}
	return ev, runSequence, receiveUs, nil
}
