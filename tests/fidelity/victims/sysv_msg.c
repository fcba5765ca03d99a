/* fidelity: a SysV message queue (id, key, mode, queued messages by type, in order) */
#include "../victim.h"
#include <sys/ipc.h>
#include <sys/msg.h>

struct msg { long type; char text[32]; };

int main(void)
{
	fid_init();
	int id = msgget(0xf1df, IPC_CREAT | IPC_EXCL | 0620);
	MUST(id);
	const struct msg sent[] = {{2, "two"}, {1, "one"}, {2, "two again"}, {3, "three"}};
	for (int i = 0; i < 4; i++)
		MUST(msgsnd(id, &sent[i], strlen(sent[i].text) + 1, 0));
	struct msqid_ds ds = {0};
	MUST(msgctl(id, IPC_STAT, &ds));
	ds.msg_qbytes = 4000;
	MUST(msgctl(id, IPC_SET, &ds));
	ready();
	wait_term();
	EQ("id by key", msgget(0xf1df, 0), id);
	MUST(msgctl(id, IPC_STAT, &ds));
	EQ("messages", ds.msg_qnum, 4);
	EQ("bytes", ds.msg_cbytes, 4 + 4 + 10 + 6);
	EQ("queue size", ds.msg_qbytes, 4000);
	EQ("mode", ds.msg_perm.mode & 0777, 0620);
	struct msg m;
	static const struct { long type; int want; } take[] = {{2, 0}, {2, 2}, {0, 1}, {0, 3}};
	for (int i = 0; i < 4; i++) {  /* type 2 in order, then what is left in order */
		memset(&m, 0, sizeof m);
		ssize_t n = msgrcv(id, &m, sizeof m.text, take[i].type, IPC_NOWAIT);
		int want = take[i].want;
		CHECK(n > 0 && m.type == sent[want].type && !strcmp(m.text, sent[want].text),
		      "message %d: type %ld '%s', want type %ld '%s'", i, m.type, m.text, sent[want].type, sent[want].text);
	}
	msgctl(id, IPC_RMID, 0);
	return report();
}
