package attnservetest

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"
)

// CheckBoolFlag checks a command's boolean flag --name through its flag parser: off unset, on
// given, the last of several wins, beside `other` (another flag of the command) too; --help shows
// it with `helpMentions` in its text; a value that is not a boolean is refused. parse returns the
// flag's value as parsed, writing usage to its writer.
func CheckBoolFlag(t *testing.T, name, other, helpMentions string,
	parse func(args []string, usage io.Writer) (bool, error)) {
	t.Helper()
	flagArg := "--" + name
	for _, tc := range []struct {
		args []string
		want bool
	}{
		{nil, false},
		{[]string{flagArg}, true},
		{[]string{flagArg + "=true", other}, true},
		{[]string{flagArg, flagArg + "=false"}, false},
	} {
		got, err := parse(tc.args, io.Discard)
		if err != nil || got != tc.want {
			t.Errorf("%q: %s %v, %v; want %v", tc.args, name, got, err, tc.want)
		}
	}
	var help bytes.Buffer
	if _, err := parse([]string{"--help"}, &help); !errors.Is(err, flag.ErrHelp) ||
		!strings.Contains(help.String(), "-"+name) || !strings.Contains(help.String(), helpMentions) {
		t.Errorf("--help: %v\n%s", err, help.String())
	}
	if _, err := parse([]string{flagArg + "=maybe"}, io.Discard); err == nil {
		t.Errorf("%s=maybe accepted", flagArg)
	}
}
