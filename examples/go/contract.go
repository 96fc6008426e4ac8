// The contract's derived values (docs/contract.md): shard ids, plan event ids,
// fingerprint digests and rows of format 2 with their hash chain.
package main

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/big"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"unicode/utf16"

	"lukechampine.com/blake3"
)

func blake3Hex(data []byte) string {
	sum := blake3.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// shardID is "s-" + the first 32 hex characters of blake3(input digest "\n" JCS(params)).
func shardID(inputBlake3 string, params interface{}) (string, error) {
	text, err := canonical(params)
	if err != nil {
		return "", err
	}
	return "s-" + blake3Hex(append([]byte(inputBlake3+"\n"), text...))[:32], nil
}

// planEntry is one shard of a plan, as the SDKs build it.
type planEntry struct {
	ShardID         string
	InputRef        string
	InputBytes      int64
	InputBlake3     string
	Params          interface{}
	ExpectedOutputs []string
	PlanLine        string
	PlanIndex       int64
}

func (e planEntry) paramsJSON() (string, error) {
	text, err := canonical(e.Params)
	return string(text), err
}

// planEventID is "plan-" + 32 hex characters of blake3(JCS of the plan's identity).
func planEventID(namespace, runID string, e planEntry) (string, error) {
	params, err := e.paramsJSON()
	if err != nil {
		return "", err
	}
	outputs := make([]interface{}, len(e.ExpectedOutputs))
	for i, name := range e.ExpectedOutputs {
		outputs[i] = name
	}
	material, err := canonical(map[string]interface{}{
		"namespace": namespace,
		"run_id":    runID,
		"shard_id":  e.ShardID,
		"definition": map[string]interface{}{
			"input_ref":        e.InputRef,
			"input_bytes":      e.InputBytes,
			"input_blake3":     e.InputBlake3,
			"params_json":      params,
			"expected_outputs": outputs,
		},
		"plan_line":  e.PlanLine,
		"plan_index": e.PlanIndex,
	})
	if err != nil {
		return "", err
	}
	return "plan-" + blake3Hex(material)[:32], nil
}

// GPU identity and health are not part of the digest (docs/contract.md).
var identityKey = regexp.MustCompile(`(?s)^gpu\.[0-9]+\.(uuid|ecc\..+)$`)

// fingerprintDigest is blake3 hex of JCS(the map without identity keys); "" for no map.
func fingerprintDigest(fields map[string]string) (string, error) {
	if len(fields) == 0 {
		return "", nil
	}
	kept := map[string]interface{}{}
	for k, v := range fields {
		if !identityKey.MatchString(k) {
			kept[k] = v
		}
	}
	text, err := canonical(kept)
	if err != nil {
		return "", err
	}
	return blake3Hex(text), nil
}

// legacyFingerprintDigest is the digest SDKs computed before RFC 8785 (Python's
// json.dumps(sort_keys=True, separators=(",", ":")), non-ASCII escaped): the ledger
// still accepts it from a spool and stores the RFC 8785 digest instead.
func legacyFingerprintDigest(fields map[string]string) string {
	if len(fields) == 0 {
		return ""
	}
	keys := []string{}
	for k := range fields {
		if !identityKey.MatchString(k) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys) // UTF-8 byte order is code point order, as Python sorts
	var b strings.Builder
	b.WriteByte('{')
	for i, k := range keys {
		if i > 0 {
			b.WriteByte(',')
		}
		writeASCII(&b, k)
		b.WriteByte(':')
		writeASCII(&b, fields[k])
	}
	b.WriteByte('}')
	return blake3Hex([]byte(b.String()))
}

// writeASCII writes a string as Python's json with ensure_ascii: everything outside
// U+0020-U+007E escaped, astral characters as a surrogate pair, lowercase hex.
func writeASCII(b *strings.Builder, s string) {
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\b':
			b.WriteString(`\b`)
		case r == '\f':
			b.WriteString(`\f`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r > 0x7e:
			if r > 0xffff {
				hi, lo := utf16.EncodeRune(r)
				fmt.Fprintf(b, `\u%04x\u%04x`, hi, lo)
			} else {
				fmt.Fprintf(b, `\u%04x`, r)
			}
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
}

// safeInts writes integers past 2^53 as decimal strings, at the two levels of an
// event's content where the schema has integers (its top level and its payload).
func safeInts(level map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(level))
	limit := big.NewInt(maxSafeInteger)
	for k, v := range level {
		if n, ok := v.(json.Number); ok {
			if i, ok := new(big.Int).SetString(string(n), 10); ok && i.CmpAbs(limit) > 0 {
				out[k] = i.String()
				continue
			}
		}
		out[k] = v
	}
	return out
}

// contentJCS is the canonical text of an event's content in row format 2.
func contentJCS(content map[string]interface{}) ([]byte, error) {
	top := safeInts(content)
	if payload, ok := top["payload"].(map[string]interface{}); ok {
		top["payload"] = safeInts(payload)
	}
	return canonical(top)
}

func rowNumber(n int64) string {
	if n > maxSafeInteger || n < -maxSafeInteger {
		return strconv.Quote(strconv.FormatInt(n, 10))
	}
	return strconv.FormatInt(n, 10)
}

// encodeRow frames an event's canonical content as a row of format 2.
func encodeRow(content []byte, runSequence, receiveTimeUs int64) []byte {
	return []byte(fmt.Sprintf(`{"event":%s,"receive_time_us":%s,"run_sequence":%s,"v":2}`,
		content, rowNumber(receiveTimeUs), rowNumber(runSequence)))
}

// chainHash is blake3(previous hash || row).
func chainHash(prev, row []byte) []byte {
	sum := blake3.Sum256(append(append([]byte{}, prev...), row...))
	return sum[:]
}
