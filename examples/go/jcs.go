// RFC 8785 (JSON Canonicalization Scheme) as docs/contract.md specifies it, from the
// standard library only: the encoding shard ids, plan events, fingerprint digests and
// rows of format 2 are computed over.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"sort"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// maxSafeInteger is 2^53 - 1: the edge of the integers every IEEE double holds.
const maxSafeInteger = 1<<53 - 1

// decodeJSON parses JSON text keeping numbers as their literal text (json.Number),
// so an integer past 2^53 is seen as the integer it is, not a rounded double.
func decodeJSON(text []byte) (interface{}, error) {
	// encoding/json turns a lone surrogate escape into U+FFFD; the contract refuses it.
	if err := checkSurrogates(text); err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.UseNumber()
	var v interface{}
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, fmt.Errorf("data after the JSON value")
	}
	return v, nil
}

// checkSurrogates refuses \uD800-\uDFFF escapes that do not form a pair.
func checkSurrogates(text []byte) error {
	pendingHigh := false
	for i := 0; i < len(text); i++ {
		if text[i] != '\\' || i+1 >= len(text) {
			if pendingHigh {
				return fmt.Errorf("a lone surrogate is not Unicode text")
			}
			continue
		}
		i++
		if text[i] != 'u' || i+4 >= len(text) {
			if pendingHigh {
				return fmt.Errorf("a lone surrogate is not Unicode text")
			}
			continue
		}
		unit, err := strconv.ParseUint(string(text[i+1:i+5]), 16, 16)
		if err != nil {
			return fmt.Errorf("bad \\u escape")
		}
		i += 4
		switch {
		case unit >= 0xD800 && unit <= 0xDBFF:
			if pendingHigh {
				return fmt.Errorf("a lone surrogate is not Unicode text")
			}
			pendingHigh = true
		case unit >= 0xDC00 && unit <= 0xDFFF:
			if !pendingHigh {
				return fmt.Errorf("a lone surrogate is not Unicode text")
			}
			pendingHigh = false
		default:
			if pendingHigh {
				return fmt.Errorf("a lone surrogate is not Unicode text")
			}
		}
	}
	if pendingHigh {
		return fmt.Errorf("a lone surrogate is not Unicode text")
	}
	return nil
}

// canonical returns the RFC 8785 bytes of a value decoded by decodeJSON or built from
// Go maps, slices, strings, bools, ints and float64s.
func canonical(v interface{}) ([]byte, error) {
	var b strings.Builder
	if err := write(&b, v); err != nil {
		return nil, err
	}
	return []byte(b.String()), nil
}

func write(b *strings.Builder, v interface{}) error {
	switch x := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		if x {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case string:
		return writeString(b, x)
	case json.Number:
		text, err := numberLiteral(string(x))
		if err != nil {
			return err
		}
		b.WriteString(text)
	case float64:
		text, err := formatDouble(x)
		if err != nil {
			return err
		}
		b.WriteString(text)
	case int:
		return write(b, int64(x))
	case int64:
		if x > maxSafeInteger || x < -maxSafeInteger {
			return fmt.Errorf("integer %d is beyond +-(2^53 - 1)", x)
		}
		b.WriteString(strconv.FormatInt(x, 10))
	case []interface{}:
		b.WriteByte('[')
		for i, item := range x {
			if i > 0 {
				b.WriteByte(',')
			}
			if err := write(b, item); err != nil {
				return err
			}
		}
		b.WriteByte(']')
	case []string:
		items := make([]interface{}, len(x))
		for i, s := range x {
			items[i] = s
		}
		return write(b, items)
	case map[string]string:
		m := make(map[string]interface{}, len(x))
		for k, s := range x {
			m[k] = s
		}
		return write(b, m)
	case map[string]interface{}:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		// RFC 8785 3.2.3: keys sort by their UTF-16 code units, not by UTF-8 bytes.
		sort.Slice(keys, func(i, j int) bool { return lessUTF16(keys[i], keys[j]) })
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteByte(',')
			}
			if err := writeString(b, k); err != nil {
				return err
			}
			b.WriteByte(':')
			if err := write(b, x[k]); err != nil {
				return err
			}
		}
		b.WriteByte('}')
	default:
		return fmt.Errorf("a %T is not JSON", v)
	}
	return nil
}

func lessUTF16(a, b string) bool {
	ua, ub := utf16.Encode([]rune(a)), utf16.Encode([]rune(b))
	for i := 0; i < len(ua) && i < len(ub); i++ {
		if ua[i] != ub[i] {
			return ua[i] < ub[i]
		}
	}
	return len(ua) < len(ub)
}

// writeString escapes as ECMAScript's JSON.stringify: the two-character forms for
// \b \t \n \f \r " \\, \u00xx (lowercase) for other controls, everything else as UTF-8.
func writeString(b *strings.Builder, s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("string is not Unicode text")
	}
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			if r < 0x20 {
				fmt.Fprintf(b, `\u%04x`, r)
			} else {
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
	return nil
}

// numberLiteral formats a JSON number literal: an integer literal must be a safe
// integer; anything else is read as the nearest IEEE double and formatted by ES6 rules.
func numberLiteral(text string) (string, error) {
	if !strings.ContainsAny(text, ".eE") {
		n, ok := new(big.Int).SetString(text, 10)
		if !ok {
			return "", fmt.Errorf("bad number %q", text)
		}
		if n.CmpAbs(big.NewInt(maxSafeInteger)) > 0 {
			return "", fmt.Errorf("integer %s is beyond +-(2^53 - 1): send it as a string", text)
		}
		return n.String(), nil
	}
	f, err := strconv.ParseFloat(text, 64)
	if err != nil {
		return "", fmt.Errorf("number %s is not a finite IEEE double", text)
	}
	return formatDouble(f)
}

// formatDouble is ECMAScript's Number.prototype.toString for finite doubles: the
// shortest digits that round-trip, plain notation for 1e-6 <= |x| < 1e21, else d.ddde+-n.
func formatDouble(f float64) (string, error) {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return "", fmt.Errorf("NaN and infinity are not JSON")
	}
	if f == 0 {
		return "0", nil // -0 too
	}
	abs := math.Abs(f)
	if abs >= 1e-6 && abs < 1e21 {
		return strconv.FormatFloat(f, 'f', -1, 64), nil
	}
	text := strconv.FormatFloat(f, 'e', -1, 64) // e.g. 1e-07, 1.5e+300
	mantissa, exp, _ := strings.Cut(text, "e")
	sign := exp[0]
	digits := strings.TrimLeft(exp[1:], "0")
	return mantissa + "e" + string(sign) + digits, nil
}
