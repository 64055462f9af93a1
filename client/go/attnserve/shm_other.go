//go:build !linux

package attnserve

import "errors"

var errNoShm = errors.New("attnserve: shared-memory regions are implemented on Linux only")

func newShmArena(size int64, prefix string, mode uint32) (*shmArena, error) { return nil, errNoShm }

func unlinkShm(name string) error { return errNoShm }

func unmapShm(mem []byte) error { return nil }
