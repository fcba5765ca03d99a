/* fidelity: inotify watches (wds, masks), one on a file deleted since but held open */
#include "../victim.h"
#include <sys/inotify.h>

int main(void)
{
	fid_init();
	MUST(mkdir("/tmp/fid-watched", 0755));
	int f = open("/tmp/fid-doomed", O_RDWR | O_CREAT, 0600);
	MUST(f);
	int in = inotify_init1(IN_NONBLOCK);
	MUST(in);
	int wd_dir = inotify_add_watch(in, "/tmp/fid-watched", IN_CREATE | IN_DELETE);
	int wd_file = inotify_add_watch(in, "/tmp/fid-doomed", IN_MODIFY);
	MUST(wd_dir | wd_file);
	MUST(unlink("/tmp/fid-doomed"));
	ready();
	wait_term();
	char buf[4096] __attribute__((aligned(8)));
	EQ("O_NONBLOCK", fcntl(in, F_GETFL) & O_NONBLOCK, O_NONBLOCK);
	MUST(write(f, "x", 1));
	close(open("/tmp/fid-watched/new", O_CREAT | O_WRONLY, 0600));
	ssize_t n = read(in, buf, sizeof buf);
	int modified = 0, created = 0;
	for (char *p = buf; n > 0 && p < buf + n;) {
		struct inotify_event *e = (void *)p;
		if (e->wd == wd_file && e->mask == IN_MODIFY)
			modified++;
		else if (e->wd == wd_dir && e->mask == IN_CREATE && !strcmp(e->name, "new"))
			created++;
		else
			fid_say("unexpected event wd %d mask %#x name '%s'", e->wd, e->mask, e->len ? e->name : "");
		p += sizeof *e + e->len;
	}
	EQ("IN_MODIFY on the deleted file's watch", modified, 1);
	EQ("IN_CREATE on the directory's watch", created, 1);
	EQ("the same watch again keeps its wd", inotify_add_watch(in, "/tmp/fid-watched", IN_CREATE | IN_DELETE), wd_dir);
	return report();
}
